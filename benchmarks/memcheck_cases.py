"""One small call of each kernel (float direct + split/combine, INT8 K, INT8 K+V in Triton; the
CUDA C++ decode for each cache kind; q_len > 1 with causal and a bias in the split-KV and the
prefill kernels, quantize, out-of-range block ids; window_left and softcap in the CUDA C++
decode's split and balanced grids and in the split-KV kernel; short queries (2-8 tokens) in
the CUDA C++ decode's column tiles and groups; on sm_90 the Gluon prefill
kernel's pipelines, cache kinds and launches, the dequantized copy of INT8 K+V pages for
long queries, and mixed_batch) for compute-sanitizer.
`memcheck_cases.py window` (or `gluon`, `short`) runs the window_left / softcap cases (or the
Gluon kernel's and mixed_batch's, the short queries') alone."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.cuda_cases import gpu_case, lengths, run

from pagedfuse.ops import cuda_native
from pagedfuse.ops.backends import cuda_decode, gluon_prefill

cases = [
    (dict(seq_lens=lengths(2)), {}),
    (dict(seq_lens=(700, 33), num_q_heads=24, num_kv_heads=4, head_dim=256),
     dict(backend="triton", splits=4)),
    (dict(seq_lens=lengths(2), head_dim=128, kind="int8_k", layout="HND"),
     dict(backend="triton", splits=2)),
    (dict(seq_lens=lengths(3, 1), num_q_heads=32, num_kv_heads=4, block_size=1,
          kind="int8_kv"), dict(backend="triton")),
    (dict(seq_lens=(1, 33, 70), num_q_heads=32, num_kv_heads=4, block_size=1,
          kind="int8_kv"), dict(backend="cuda_decode", max_query_len=1)),
    (dict(seq_lens=(300, 129), num_q_heads=24, num_kv_heads=4, head_dim=256, kind="int8_kv",
          layout="HND"), dict(backend="cuda_decode", max_query_len=1, splits=3)),
    (dict(seq_lens=lengths(2, 256), num_q_heads=10, head_dim=128, kind="int8_kv",
          block_size=256, index_dtype=torch.int64),
     dict(backend="cuda_decode", max_query_len=1)),
    (dict(seq_lens=(1, 17, 300), num_q_heads=24, num_kv_heads=4, head_dim=256),
     dict(backend="cuda_decode", max_query_len=1, splits=3)),
    (dict(seq_lens=lengths(2, 1), num_q_heads=32, num_kv_heads=4, kind="int8_k", block_size=1,
          dtype=torch.float16), dict(backend="cuda_decode", max_query_len=1)),
    (dict(seq_lens=(129, 64), num_q_heads=10, head_dim=128, kind="int8_k", layout="HND"),
     dict(backend="cuda_decode", max_query_len=1, splits=2)),
    (dict(seq_lens=(40, 20), q_lens=(5, 3), head_dim=128, causal=True, bias="bool",
          bias_shape="per_batch"), dict(backend="triton", splits=2)),
    (dict(seq_lens=(300, 40), q_lens=(130, 17), head_dim=128, causal=True, bias="bool",
          bias_shape="per_batch", dtype=torch.bfloat16), dict(backend="triton_prefill")),
    (dict(seq_lens=(300, 40), q_lens=(130, 17), head_dim=64, kind="int8_kv", causal=True,
          dtype=torch.bfloat16), dict(backend="triton_prefill")),
]
cases += [(dict(seq_lens=(300, 45, 1), num_q_heads=12, head_dim=128, kind=kind),
           dict(backend="cuda_decode", max_query_len=1, splits=2,  # one KV head per CTA
                config=cuda_decode.native_config(native, 128, 2, 3, torch.device("cuda"), 1)))
          for native, kind in cuda_native.CALL_KINDS.items()]
cases += [(dict(seq_lens=(300, 45, 1), num_q_heads=32, num_kv_heads=8, head_dim=d, kind=kind),
           dict(backend="cuda_decode", max_query_len=1,  # the balanced grid, its merges
                splits=cuda_decode.BALANCED))
          for d, kind in ((128, "int8_kv"), (64, "int8_k"), (256, "float"))]
# Short queries on the CUDA decode: four n-tiles in two column groups (INT8 K+V at head_dim
# 64), two n-tiles (INT8 K+V at 128; also with 4 KV heads per CTA), column groups of one
# (INT8 K at 128 with 2 KV heads per CTA; 16-bit at 256, also with 2), histories of 0 and 1
# key.


def short_case(num_q_heads: int, head_dim: int, native: str, heads: int | None = None):
    """Up to 7 query tokens of 4 to 8 heads a KV head (a cuda_native kind's caches): more
    columns than the kernel's n-tiles hold, so its most n-tiles (and column groups) serve
    them."""
    device = torch.device("cuda")
    tiles = cuda_native.decode_variant(device, native, head_dim).max_column_tiles
    plan = {} if heads is None else dict(config=cuda_decode.native_config(
        native, head_dim, 4, 4, device, heads, tiles=tiles))
    return (dict(seq_lens=(300, 5, 8, 40), q_lens=(5, 5, 7, 1), num_q_heads=num_q_heads,
                 num_kv_heads=4, head_dim=head_dim, kind=cuda_native.CALL_KINDS[native],
                 causal=True),
            dict(backend="cuda_decode", max_query_len=7, splits=2, **plan))


short_cases = [short_case(32, 64, "int8_kv"), short_case(16, 128, "int8_kv"),
               short_case(16, 128, "int8_kv", 4), short_case(16, 128, "int8_k", 2),
               short_case(24, 256, "half"), short_case(24, 256, "half", 2)]
# The Gluon kernel where this GPU runs it: without length hints (a packed launch for the
# short sequences, then the rest), a tail tile past each sequence, every cache kind and
# head_dim (16-bit K/V and INT8 K at head_dim 64: 128-row tiles at two CTAs per SM); K and V
# rings at page 256 (16-bit and INT8 V), and with V's own loader at page 16 (INT8 V; 16-bit
# at head_dim 256 by default); one consumer with INT8 V; consumers that stop at their own
# tiles with INT8 V (two buffers of 64 keys); the cp pipeline at page 1; INT8 V widened by
# the second warpgroup (wg1_widens) at head_dim 256, chosen and by default with its four
# buffers; two 16-bit KV heads as one (kv_pairs) at head_dim 64, in 64- and 128-row tiles;
# the output by TMA (o_tma) where a warpgroup's rows are all in the query, else by threads
# (with INT8 K, by default here and on the dequantized copy, from a V buffer);
# a tile list over 201 sequences (two steps of its search). Then mixed_batch (the CUDA
# decode's rows, the Gluon kernel's chunks), and the dequantized copy.
prefill = dict(seq_lens=(300, 45, 70), q_lens=(130, 17, 1), num_q_heads=16, num_kv_heads=4,
               causal=True)
many = (0, 1, 3, 17) * 50 + (130,)
gluon_cases = []
if gluon_prefill.supports(gpu_case(**prefill, head_dim=128, kind="int8_k").call()) is None:
    gluon_cases += [(dict(prefill, head_dim=d, kind=kind), dict(backend="gluon_prefill"))
                    for d, kind in ((128, "int8_k"), (64, "int8_kv"), (128, "int8_kv"),
                                    (256, "int8_kv"), (256, "float"), (64, "float"),
                                    (64, "int8_k"))]
    rings = dict(backend="gluon_prefill", block_n=64, stages=2, kv_rings=True)
    gluon_cases += [
        (dict(prefill, head_dim=128, block_size=256), rings),
        (dict(prefill, head_dim=128, kind="int8_kv", block_size=256), rings),
        (dict(prefill, head_dim=128, kind="int8_kv"), dict(rings, v_loader=True)),
        (dict(prefill, head_dim=128, kind="int8_kv"), dict(backend="gluon_prefill", block_m=64)),
        (dict(prefill, head_dim=128, kind="int8_kv"),
         dict(backend="gluon_prefill", block_n=64, stages=2, own_tiles=True)),
        (dict(prefill, head_dim=128, kind="int8_k", block_size=1),
         dict(backend="gluon_prefill", pipeline="cp")),
        (dict(prefill, head_dim=256, kind="int8_kv", q_lens=(4, 17, 1)),
         dict(backend="gluon_prefill", block_m=128, wg1_widens=True, ctas_per_sm=1)),
        (dict(prefill, head_dim=256, kind="int8_kv", q_lens=(4, 3, 1)),
         dict(backend="gluon_prefill", max_query_len=4)),
        *((dict(prefill, head_dim=64, q_lens=(4, 3, 1), num_q_heads=32),
           dict(backend="gluon_prefill", max_query_len=4, kv_pairs=True, pack=16,
                block_m=block_m, block_n=64, stages=4)) for block_m in (64, 128)),
        (dict(prefill, head_dim=128), dict(backend="gluon_prefill", o_tma=True)),
        (dict(prefill, head_dim=128, q_lens=many, seq_lens=tuple(q + 20 for q in many)),
         dict(backend="gluon_prefill")),
        (dict(prefill, head_dim=128, kind="int8_kv"),
         dict(backend="mixed_batch", max_query_len=130))]
    # INT8 K+V queries of DEQUANT_V_FROM tokens a sequence: the dequantized copy of the
    # pages (strided caches in HND), then the INT8 K kernel on it
    gluon_cases += [(dict(seq_lens=(700, 600), q_lens=(600, 520), num_q_heads=16,
                          num_kv_heads=4, causal=True, head_dim=d, kind="int8_kv",
                          layout=layout), dict(backend="gluon_prefill"))
                    for d, layout in ((128, "NHD"), (64, "HND"))]
    # a mixed batch's long INT8 K+V chunks: a copy of their own pages, ranked
    gluon_cases += [(dict(seq_lens=(700, 600, 90, 530), q_lens=(1, 600, 1, 520),
                          num_q_heads=16, num_kv_heads=4, causal=True, head_dim=128,
                          kind="int8_kv"), dict(backend="mixed_batch", max_query_len=600))]
window_cases = [
    (dict(seq_lens=(300, 45, 1000), num_q_heads=32, num_kv_heads=8, head_dim=d, kind=kind,
          window_left=100, softcap=cap),
     dict(backend="cuda_decode", max_query_len=1, splits=splits))
    for d, kind, cap, splits in ((128, "int8_kv", None, 3), (64, "int8_k", 30.0, 1),
                                 (256, "float", 30.0, cuda_decode.BALANCED),
                                 (128, "int8_kv", 30.0, cuda_decode.BALANCED))]
window_cases += [(dict(seq_lens=(300, 45, 9), q_lens=(5, 1, 8), num_q_heads=32, num_kv_heads=4,
                       head_dim=64, kind="int8_k", causal=True, window_left=20, softcap=30.0),
                  dict(backend="cuda_decode", max_query_len=8, splits=3))]
window_cases += [(dict(seq_lens=(300, 45, 70), q_lens=(5, 1, 3), head_dim=128, kind=kind,
                       causal=True, window_left=16, softcap=30.0),
                  dict(backend="triton", splits=2)) for kind in ("float", "int8_kv")]
groups = {"window": window_cases, "gluon": gluon_cases, "short": short_cases}
cases = groups[sys.argv[1]] if sys.argv[1:] else (cases + short_cases + gluon_cases +
                                                  window_cases)
for spec, kw in cases:
    case = gpu_case(**spec)
    case.block_table[0, 0] = 10**6  # clamped inside the kernel, never read out of bounds
    run(case, **kw)
torch.ops.pagedfuse.quantize_int8(torch.randn(5, 7, 128, device="cuda"))
torch.cuda.synchronize()
print("memcheck cases ran")
