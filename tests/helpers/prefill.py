"""What the prefill kernels' tests share: a PagedCall built straight from tensors, as the op's
validation would (the tests and the benchmark call kernels without the op around it), and
the varlen batches every prefill backend is held to."""

from __future__ import annotations

import math

import torch

from helpers.cases import Case, make_case
from pagedfuse.ops.call import FLOAT_OP, INT8_OP, Geometry, PagedCall

# (q_len, history) pairs from issue 22's lists (q_len 1, 4, 17, 128, 2048; histories 0, 1,
# 1000, 8192), over head_dim 64/128/256, GQA 1/4/6/8, pages 1/16/256, NHD and HND, bf16 and
# fp16, int32 and int64 indices, causal or not.
VARLEN_CASES = {
    "llama3-varlen-page16": dict(q_lens=[1, 4, 17, 128, 2048], histories=[1000, 0, 1, 8192, 0],
                                 num_q_heads=32, num_kv_heads=8, head_dim=128),
    "qwen35-gqa6-hnd-page256": dict(q_lens=[17, 300, 4], histories=[1000, 0, 8192],
                                    num_q_heads=24, num_kv_heads=4, head_dim=256,
                                    block_size=256, layout="HND"),
    "tinyllama-gqa8-fp16": dict(q_lens=[4, 128, 1, 33], histories=[1, 1000, 0, 8192],
                                num_q_heads=32, num_kv_heads=4, head_dim=64,
                                dtype=torch.float16),
    "page1-gqa4": dict(q_lens=[5, 64], histories=[40, 0], num_q_heads=16, num_kv_heads=4,
                       head_dim=128, block_size=1),
    "mha-noncausal-int64": dict(q_lens=[64, 5], histories=[0, 100], num_q_heads=8,
                                num_kv_heads=8, head_dim=128, causal=False,
                                index_dtype=torch.int64),
}


def varlen_case(q_lens: list[int], histories: list[int], **spec) -> Case:
    """A causal bf16 CUDA batch of sequences with these query lengths after these histories
    (``spec``: make_case's other arguments, which override those)."""
    return make_case(seq_lens=[q + h for q, h in zip(q_lens, histories, strict=True)],
                     q_lens=q_lens, **{"causal": True, "dtype": torch.bfloat16,
                                       "device": "cuda", **spec})


def named_varlen_case(name: str, **spec) -> Case:
    """VARLEN_CASES[name] (``spec`` overrides or adds make_case arguments)."""
    table = {**VARLEN_CASES[name], **spec}
    return varlen_case(table.pop("q_lens"), table.pop("histories"), **table)


def paged_call(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               block_table: torch.Tensor, seq_lens: torch.Tensor,
               query_start_loc: torch.Tensor, scale: float, causal: bool,
               attn_bias: torch.Tensor | None = None, key_scale: torch.Tensor | None = None,
               value_scale: torch.Tensor | None = None, max_seq_len: int | None = None,
               max_query_len: int | None = None) -> PagedCall:
    """A PagedCall with its Geometry read off the shapes."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    batch, max_blocks = block_table.shape
    geo = Geometry(num_tokens, num_q_heads, num_kv_heads, head_dim, num_blocks, block_size,
                   batch, max_blocks)
    return PagedCall(INT8_OP if key_scale is not None else FLOAT_OP, query, key_cache,
                     value_cache, key_scale, value_scale, block_table, seq_lens,
                     query_start_loc, scale, causal, attn_bias, max_seq_len, max_query_len, geo)


def structured_biases(q_lens: list[int], histories: list[int], num_q_heads: int
                      ) -> dict[str, torch.Tensor]:
    """Biases (CPU, float32 or bool) that hide whole key tiles, as serving stacks build them:
    bottom-right causal as finfo.min, -inf or a bool mask; two requests packed block-diagonally
    (transformers' continuous batching); a padded tail with a row that sees nothing; an
    ALiBi slope under a causal mask (visible keys with non-zero biases); a NaN inside a
    row's span; a per-head band (one head sees every key); and a dense random bias. Rows
    are query positions of the longest query, columns key positions of the longest
    sequence."""
    rows = max(q_lens)
    cols = max(q + h for q, h in zip(q_lens, histories, strict=True))
    i, j = torch.arange(rows)[:, None], torch.arange(cols)[None, :]
    hide = j > i + cols - rows
    causal_min = torch.zeros(rows, cols).masked_fill(hide, torch.finfo(torch.float32).min)
    packed = hide | ((i < rows // 2) & (j >= (cols + rows // 2) // 2))
    padded = torch.zeros(rows, cols).masked_fill(hide | (j >= cols - 5), -math.inf)
    padded[rows // 3] = -math.inf
    slope = -0.1 * (j - i - (cols - rows)).abs().float()
    with_nan = causal_min.clone()
    with_nan[rows - 1, cols // 2] = math.nan
    band = torch.zeros(num_q_heads, rows, cols).masked_fill(
        hide | (j <= i + cols - rows - 9), -math.inf)
    band[1] = 0.0
    return {
        "causal-finfo-min": causal_min,
        "causal-inf": torch.zeros(1, 1, rows, cols).masked_fill(hide, -math.inf),
        "causal-bool": ~hide,
        "packed-requests": torch.zeros(1, 1, rows, cols).masked_fill(packed, -1e38),
        "padded-hidden-row": padded,
        "alibi-causal": slope.masked_fill(hide, -math.inf)[None, None].expand(
            len(q_lens), num_q_heads, rows, cols),
        "nan-in-span": with_nan,
        "per-head-band": band,
        "dense-random": torch.randn(rows, cols, generator=torch.Generator().manual_seed(3)),
    }
