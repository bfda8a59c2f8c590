"""harness.key_step, bench/gluon_sass.py's reading of a key loop in SASS: which loop is the unmasked key step, and its
counts per key block.

The listing is written by hand in ``cuobjdump -sass``'s layout, cut down from the Gluon forward's
own (head_dim 64, 128-key blocks: 4 + 8 wgmma a block)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # bench/ is not a package

import harness  # noqa: E402


def _listing(loops: list) -> str:
    """SASS lines for ``loops`` (each a list of instruction texts; a branch back closes each)."""
    lines, at = [], 0x100
    for body in loops:
        start = at
        for text in body:
            lines.append(f"        /*{at:04x}*/                   {text} ;")
            at += 0x10
        lines.append(f"        /*{at:04x}*/               @P1 BRA 0x{start:x} ;")
        at += 0x10
    return "\n".join(lines)


STEP = ["HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ"] * 4 + ["HGMMA.64x64x16.F32.BF16 R88, R120, gdesc[UR8]"] * 8 \
    + ["MUFU.EX2 R3, R3"] * 66 + ["FADD.FTZ.RM R4, R5, 12582912"] * 2 + ["IMAD.MOV.U32 R120, RZ, RZ, R160"] * 3 \
    + ["PRMT R120, R120, 0x5432, R120"]
MASKED = STEP + ["FSEL R5, R5, -INF , P1"]


def test_the_unmasked_step_is_read_per_key_block():
    sass = _listing([MASKED, STEP])  # the masked loop (FSEL) comes first and is passed over
    assert harness.key_step(sass, 64, 128) == dict(
        instructions=len(STEP) + 1, exp2_unit=66, emulated=2, moves=3, permutes=1, blocks_a_trip=1)


def test_a_loop_of_two_blocks_is_divided_by_two_and_outer_loops_are_passed_over():
    outer = STEP * 3  # more than two blocks a trip: a tile's loop around the key loops
    counts = harness.key_step(_listing([outer, STEP + STEP]), 64, 128)
    assert counts["blocks_a_trip"] == 2 and counts["exp2_unit"] == 66 and counts["instructions"] == len(STEP) + 0.5
    assert harness.key_step(_listing([outer]), 64, 128) == {}
