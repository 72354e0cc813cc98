"""benchmarks/prefill_asm.py's SASS key-loop count on a hand-written listing: the loop it
picks, the paths of one iteration and what it takes as not taken, since the per-path
instruction counts in benchmarks/results/prefill_summary.md come from it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import prefill_asm  # noqa: E402


def listing(lines: list[tuple[str, str]]) -> str:
    """cuobjdump-style lines, 16 bytes apart from 0x0: (predicate, instruction)."""
    return "\n".join(f"        /*{16 * i:04x}*/ {pred:>8} {ins} ;"
                     for i, (pred, ins) in enumerate(lines))


def test_sass_loop_counts_the_paths_of_the_innermost_gmma_loop():
    sass = listing([
        ("", "MOV R1, c[0x0][0x28]"),           # 0x00
        ("", "HGMMA.64x64x16.F32 R0, gdesc, R0"),  # 0x10 an outer loop's GMMA
        ("", "SYNCS.PHASECHK P0, [UR4], R2"),   # 0x20 the key loop's head
        ("@!P0", "BRA 0x20"),                    # 0x30 a barrier wait: taken as not taken
        ("", "IGMMA.64x128x32.S32 R0, gdesc, R0"),  # 0x40
        ("@P1", "BRA 0x80"),                     # 0x50 fork: the masked path
        ("", "FMUL R3, R3, R4"),                 # 0x60 every row reads the tile
        ("", "BRA 0xb0"),                        # 0x70 to the merge
        ("", "FSEL R5, R5, -INF, P2"),           # 0x80 masked
        ("", "FSEL R3, R3, -INF, P3"),           # 0x90
        ("", "FMUL R3, R3, R4"),                 # 0xa0
        ("", "MUFU.EX2 R3, R3"),                 # 0xb0 merge
        ("@!P4", "BRA 0x300"),                   # 0xc0 a wait's slow path, out of the loop
        ("@P5", "BRA 0x20"),                     # 0xd0 the back edge
        ("@P6", "BRA 0x10"),                     # 0xe0 the outer loop's back edge
        ("", "EXIT"),                            # 0xf0
    ])
    loop = prefill_asm.sass_loop(sass)["sass_loop"]
    # head 0x20 .. back edge 0xd0: 0x20-0x70 then 0xb0-0xd0, or 0x20-0x50 then 0x80-0xd0
    assert loop["paths"] == 2
    assert loop["min"] == 6 + 3
    assert loop["max"] == 4 + 6
    assert loop["ops"]["IGMMA"] == 1 and loop["ops"]["MUFU"] == 1 and "FSEL" not in loop["ops"]


def test_sass_loop_without_gmma_is_none():
    sass = listing([("", "FMUL R3, R3, R4"), ("@P0", "BRA 0x0"), ("", "EXIT")])
    assert prefill_asm.sass_loop(sass) == {"sass_loop": None}
