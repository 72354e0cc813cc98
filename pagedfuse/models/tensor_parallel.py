"""Tensor parallelism for the paged decoder, on torch.distributed's own tensor-parallel API.

Every rank builds the full model from the same seed, then ``parallelize`` shards it with
``parallelize_module`` over a 1-D ``DeviceMesh``: the Q, K and V projections (and the MLP's gate
and up) are ``ColwiseParallel``, so each rank computes its own heads; the output and down
projections are ``RowwiseParallel``, whose output is the all-reduce of the ranks' partial sums.
Between them each rank's attention is the unchanged single-GPU code on plain rank-local
tensors (its query heads, its KV heads, its own paged cache), which is what pagedfuse matches
and rewrites on every rank. Embedding, norms and LM head stay replicated.

Heads are split as serving engines split them (vLLM's rule): with num_kv_heads >= world size
each rank gets num_kv_heads / world_size KV heads; with fewer, world_size / num_kv_heads ranks
share one replicated KV head, so every rank attends with one KV head and keeps the model's
query-to-KV mapping (qwen35's 24 query and 4 KV heads at tp=8: 3 query heads and one KV head
per rank, each KV head on 2 ranks).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from pagedfuse.models.decoder import PagedAttention, PagedDecoder
from pagedfuse.models.presets import DecoderConfig

# Module paths (relative to PagedDecoder) and how each is sharded.
_COLWISE = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate", "mlp.up")
_ROWWISE = ("attn.o_proj", "mlp.down")


@dataclass(frozen=True)
class HeadShard:
    """The heads one rank holds: global query and KV head ids, and how many ranks hold each
    of its KV heads (1: no replication)."""

    rank: int
    world_size: int
    q_heads: range
    kv_heads: range
    kv_replicas: int


def head_shard(num_q_heads: int, num_kv_heads: int, world_size: int, rank: int) -> HeadShard:
    """Rank ``rank``'s heads among ``world_size`` ranks. Query heads split evenly; KV heads
    split evenly when world_size divides them, else each is replicated on world_size /
    num_kv_heads consecutive ranks (which then hold exactly the query heads that read it)."""
    if world_size < 1:
        raise ValueError(f"world_size: must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: {rank} not in [0, {world_size})")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads: {num_q_heads} is not a multiple of num_kv_heads "
                         f"{num_kv_heads}")
    if num_q_heads % world_size:
        raise ValueError(f"num_q_heads: {num_q_heads} query heads do not split evenly over "
                         f"{world_size} ranks")
    if num_kv_heads >= world_size:
        if num_kv_heads % world_size:
            raise ValueError(f"num_kv_heads: {num_kv_heads} KV heads neither split evenly over "
                             f"{world_size} ranks nor divide it (for replication)")
        per_rank, replicas = num_kv_heads // world_size, 1
        first_kv = rank * per_rank
    else:
        if world_size % num_kv_heads:
            raise ValueError(f"num_kv_heads: {num_kv_heads} KV heads do not divide {world_size} "
                             "ranks, so they cannot be replicated evenly")
        per_rank, replicas = 1, world_size // num_kv_heads
        first_kv = rank // replicas
    q_per_rank = num_q_heads // world_size
    return HeadShard(rank, world_size, range(rank * q_per_rank, (rank + 1) * q_per_rank),
                     range(first_kv, first_kv + per_rank), replicas)


def rank_config(config: DecoderConfig, world_size: int, rank: int) -> DecoderConfig:
    """The config of one rank's attention and cache: its query and KV heads only."""
    if config.intermediate_size % world_size:
        raise ValueError(f"intermediate_size: {config.intermediate_size} does not split evenly "
                         f"over {world_size} ranks")
    shard = head_shard(config.num_q_heads, config.num_kv_heads, world_size, rank)
    return dataclasses.replace(config, num_q_heads=len(shard.q_heads),
                               num_kv_heads=len(shard.kv_heads))


@torch.no_grad()
def _replicate_kv_heads(attn: PagedAttention, replicas: int) -> None:
    """Repeat each KV head's rows of k_proj and v_proj ``replicas`` times, so the even row split
    ColwiseParallel makes hands every rank whole heads: its replicated KV head. This is the one
    step outside the tensor-parallel API: its styles only split evenly, and KV replication
    needs the same rows on several ranks (vLLM, too, replicates these rows when it loads
    weights rather than in a collective)."""
    head_dim = attn.config.head_dim
    for proj in (attn.k_proj, attn.v_proj):
        rows = proj.weight.unflatten(0, (-1, head_dim)).repeat_interleave(replicas, dim=0)
        proj.weight = nn.Parameter(rows.flatten(0, 1), requires_grad=proj.weight.requires_grad)


def parallelize(model: PagedDecoder, mesh: DeviceMesh) -> PagedDecoder:
    """Shard ``model`` (in place; returned) over the 1-D ``mesh``: this rank keeps its heads
    and its slice of the MLP, and ``model.config`` becomes the rank's config, so
    ``model.new_cache`` allocates this rank's paged cache (its KV heads only). Every rank must
    have built ``model`` identically (same config and seed)."""
    if mesh.ndim != 1:
        raise ValueError(f"mesh: must be 1-D (the tensor-parallel dimension), got {mesh.ndim}-D")
    world_size, rank = mesh.size(), mesh.get_local_rank()
    config = model.config
    local = rank_config(config, world_size, rank)
    shard = head_shard(config.num_q_heads, config.num_kv_heads, world_size, rank)
    plan: dict[str, ColwiseParallel | RowwiseParallel] = {}
    for i, layer in enumerate(model.layers):
        attn = layer.attn
        if shard.kv_replicas > 1:
            _replicate_kv_heads(attn, shard.kv_replicas)
        attn.config = local
        if config.alibi:  # per-head constants: this rank's heads' slopes, no collective needed
            attn.slopes = attn.slopes[shard.q_heads.start:shard.q_heads.stop].clone()
        plan.update({f"layers.{i}.{path}": ColwiseParallel() for path in _COLWISE})
        plan.update({f"layers.{i}.{path}": RowwiseParallel() for path in _ROWWISE})
    parallelize_module(model, mesh, plan)
    model.config = local
    return model


def init_from_env(device_type: str) -> DeviceMesh:
    """The 1-D tensor-parallel mesh over all ranks, its process group (gloo on the CPU, NCCL on
    CUDA) from the variables torchrun sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). On
    CUDA this rank's current device becomes cuda:LOCAL_RANK, so "cuda" means its own GPU."""
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if v not in os.environ]
    if missing:
        raise RuntimeError(f"tensor parallelism: {', '.join(missing)} not set; launch with "
                           "torchrun --nproc-per-node N")
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("tp",))
