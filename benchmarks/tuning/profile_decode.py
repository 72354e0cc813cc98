"""One decode method on one benchmark case, called a few times: a target for Nsight Compute.

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats \\
        -k regex:paged_decode --launch-skip 2 --launch-count 1 \\
        python benchmarks/tuning/profile_decode.py --geo llama3_8b --batch 64 --length 8192 \\
        --kind int8_kv
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules

import torch  # noqa: E402
from decode_cases import GEOMETRIES, NATIVE_KIND, Case, contiguous_out, pf_call  # noqa: E402

from pagedfuse.ops.backends import cuda_decode  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geo", choices=GEOMETRIES, default="llama3_8b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--kind", choices=("bf16", "int8_kv", "int8_k", "contiguous"),
                        default="int8_kv")
    parser.add_argument("--in-order", action="store_true", help="blocks in order, not shuffled")
    parser.add_argument("--heads", type=int, help="the CUDA C++ decode's KV heads per CTA "
                        "(default: the op's)")
    parser.add_argument("--splits", type=int, help="split-KV count (default: the op's)")
    parser.add_argument("--calls", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    case = Case(GEOMETRIES[args.geo], args.batch, args.length, shuffle=not args.in_order)
    if args.kind == "contiguous":
        call = lambda: contiguous_out(case)  # noqa: E731
    else:
        backend = None if args.heads is None else "cuda_decode"
        config = backend and cuda_decode.native_config(
            NATIVE_KIND[args.kind], case.geo[2], case.geo[1], case.batch, torch.device("cuda"),
            args.heads)
        call = lambda: pf_call(case, args.kind, backend, config=config,  # noqa: E731
                                splits=args.splits)
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
