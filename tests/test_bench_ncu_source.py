"""bench/ncu_source.py's reading of Nsight Compute's source page (SASS, one row per instruction):
each instruction sorted into a kind by its opcode, the kinds' and the stall reasons' shares of the
samples, and the instructions that hold the most samples with their largest reason.

The page here is written by hand in the layout the script reads (the columns ``ncu --page source
--csv --print-source sass`` prints and bench/ncu_gluon_bwd.py read on an H200)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # bench/ is not a package

import ncu_source  # noqa: E402

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
          "stall_long_scoreboard", "stall_wait", "stall_barrier", "stall_barrier (Not Issued)", "stall_math_pipe_throttle"]
ROWS = [
    ["0x10", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT, gsb0 ;", "10", "8", "0", "10", "0", "99", "0"],
    ["0x20", "WARPGROUP.DEPBAR.LE gsb0, 0x0 ;", "40", "8", "0", "35", "5", "99", "0"],
    ["0x30", "@!P0 SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR8+0x28000], R3 ;", "20", "8", "20", "0", "0", "0", "0"],
    ["0x40", "MUFU.EX2 R7, R6 ;", "25", "512", "0", "5", "0", "0", "20"],
    ["0x50", "@P1 FMUL R88, R88, R61 ;", "5", "256", "0", "5", "0", "0", "0"],
]


@pytest.mark.parametrize("sass, kind", [
    ("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ ;", "matmul issue"),
    ("WARPGROUP.DEPBAR.LE gsb0, 0x0 ;", "matmul wait"),
    ("@!P0 SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR10+0x28190], RZ ;", "mbarrier"),
    ("BAR.SYNC.DEFER_BLOCKING 0x2, 0x80 ;", "barrier"),
    ("MUFU.EX2 R7, R6 ;", "exp2"),
    ("@P1 FMUL R88, R88, R61 ;", "float"),
    ("F2FP.BF16.F32.PACK_AB R16, R30, R27 ;", "float"),
    ("SHFL.BFLY PT, R3, R2, 0x1, 0x1f ;", "shuffle"),
    ("@!P1 BRA 0x4bb0 ;", "branch"),
    ("LDG.E.128 R4, desc[UR6][R2.64] ;", "memory"),
    ("UTMALDG.4D [UR8], [UR4] ;", "memory"),
    ("IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28] ;", "other"),
])
def test_each_instruction_is_sorted_by_its_opcode_predicate_left_out(sass, kind):
    assert ncu_source.kind(sass) == kind


def test_the_page_is_summarised_as_shares_of_all_samples():
    summary = ncu_source.summarise(HEADER, ROWS, top=2)
    assert summary["kinds"] == {"matmul wait": 0.4, "exp2": 0.25, "mbarrier": 0.2, "matmul issue": 0.1, "float": 0.05}
    # the 'Not Issued' duplicate of a reason is not counted twice
    assert summary["stalls"] == {"long_scoreboard": 0.2, "wait": 0.55, "barrier": 0.05, "math_pipe_throttle": 0.2}
    assert summary["hot"] == [(0.4, "wait", "WARPGROUP.DEPBAR.LE gsb0, 0x0 ;"), (0.25, "math_pipe_throttle", "MUFU.EX2 R7, R6 ;")]
