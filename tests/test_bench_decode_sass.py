"""bench/decode_sass.py: the decode kernel's key loop read out of its sm90 SASS, compiled offline,
per way of finding a paged cache's pages; and harness.sass_loops, the loops of a listing."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))  # bench/ is not a package

import decode_sass  # noqa: E402
import harness  # noqa: E402
from test_bench_gluon_sass import _listing  # noqa: E402  (a listing in cuobjdump's layout)


def test_each_branch_back_closes_one_loop():
    short = ["IADD3 R2, R2, 0x1, RZ"]
    long = ["LDGSTS.E.BYPASS.128 [R3], desc[UR4][R4.64]", "HMMA.16816.F32.BF16 R8, R12, R16, R8"] * 3
    sass = _listing([short, long])
    loops = harness.sass_loops(sass)
    assert [len(body) for body in loops] == [len(short) + 1, len(long) + 1]  # each with its branch
    assert decode_sass.longest_loop(sass)[:2] == long[:2]
    assert decode_sass.longest_loop(_listing([])) == []  # straight-line code: no loop


def test_every_mode_compiles_and_its_loop_found_is_the_key_loop(tmp_path):
    """The script compiled for sm90 with this Triton (in a child process: the tests' own process
    runs the kernels under the interpreter): every mode's longest loop issues exactly one block of
    keys' K and V copies (16-byte async copies spread over the tile's threads). How many
    instructions each mode takes depends on the Triton release, so no order is asserted."""
    done = subprocess.run([sys.executable, str(BENCH / "decode_sass.py"), "--out", str(tmp_path), "--commit", "test"],
                          env=harness.child_env(TRITON_INTERPRET="0"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {row["mode"]: row for row in json.loads((tmp_path / "decode_sass.json").read_text())["rows"]}
    assert list(rows) == list(decode_sass.MODES)
    decode = importlib.import_module(harness.shipped_kernel().__name__ + "._triton_decode")
    block_n, warps, _ = decode.ONE_SPLIT_CONFIG_SM90[decode_sass.HEAD_DIM]
    copies = 2 * block_n * decode_sass.HEAD_DIM * 2 // (16 * 32 * warps)  # K and V, bf16, per thread
    assert {row["copies"] for row in rows.values()} == {copies}
    dense = rows["dense cache"]["loop"]
    assert all(row["vs_dense"] == row["loop"] / dense for row in rows.values())  # each loop over the dense one
    assert "| dense cache | " in (tmp_path / "decode_sass.md").read_text()
