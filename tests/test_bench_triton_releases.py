"""bench/triton_releases.py's comparison of one release's compiled kernel with another's: identical
listings, and the opcodes whose counts moved (a predicated instruction counted by its opcode)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _script(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # bench/ is not a package
    spec = importlib.util.spec_from_file_location("_bench_triton_releases", BENCH / "triton_releases.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(triton, lines, step=None):
    return dict(triton=triton, kernel="forward", head_dim=128, causal=True, compile_s=1.5,
                instructions=len(lines), registers=168, stack=0, step=step or {}, lines=lines)


BASE = ["HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ", "@P0 MUFU.EX2 R3, R3", "MUFU.EX2 R4, R4",
        "UIMAD UR4, UR5, UR6, URZ", "BAR.SYNC.DEFER_BLOCKING 0x0"]


def test_the_same_listing_is_identical_and_moves_no_opcode(monkeypatch):
    row = _script(monkeypatch).compare(_run("3.6.0", BASE), _run("3.6.0", list(BASE), dict(instructions=5.0)))
    assert row["identical"] == "yes" and row["differences"] == "—"
    assert row["step_instructions"] == 5.0 and row["causal"] == "yes"


def test_opcodes_counted_differently_are_listed_largest_change_first(monkeypatch):
    other = BASE[:3] + ["@!P1 ELECT P2, URZ, PT", "ELECT P3, URZ, PT", "VOTEU.ANY UR4, UPT, P2"]
    row = _script(monkeypatch).compare(_run("3.6.0", BASE), _run("3.7.1", other))
    assert row["identical"] == "no" and row["triton"] == "3.7.1"
    # ELECT twice (once predicated), VOTEU.ANY once in; UIMAD and BAR.SYNC out; MUFU.EX2 unmoved
    assert row["differences"] == "ELECT +2, BAR.SYNC.DEFER_BLOCKING -1, UIMAD -1, VOTEU.ANY +1"
