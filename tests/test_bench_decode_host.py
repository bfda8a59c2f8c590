"""bench/decode_host.py: the smoke run (a tiny shape through the interpreter) times every
variant of the decode call, each giving sdpa's result; a variant's settings are put back after
its row (harness.settings)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))  # bench/ is not a package

import harness  # noqa: E402


def test_the_smoke_run_times_every_variant_and_each_agrees_with_sdpa(tmp_path):
    done = subprocess.run([sys.executable, str(BENCH / "decode_host.py"), "--smoke", "--out", str(tmp_path)],
                          env=harness.child_env(TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "decode_host.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["shipped", "capture query asked", "kept launches", "launcher key each call",
                                            "fresh partials",
                                            "two kernels", "one slice", "Python only",
                                            "shipped, timed by part", "sdpa"]
    for row in rows:
        assert row["host_us"] > 0, row
        if "max_error" in row:
            assert row["max_error"] < 2e-2, row
    parts = dict(p.rsplit(" ", 1) for p in rows[-2]["parts"].split(" / "))
    assert list(parts) == ["decode_attention", "_alloc", "_SPLIT", "C launch"]
    assert float(parts["decode_attention"]) >= float(parts["_SPLIT"]) > 0


def test_a_variant_is_put_back_after_its_row():
    fa = harness.shipped_kernel()
    dec = importlib.import_module(fa.__name__ + "._triton_decode")
    merge, choose = dec.MERGE_IN_KERNEL, dec.choose_num_splits
    with harness.settings({(dec, "MERGE_IN_KERNEL"): not merge, (dec, "choose_num_splits"): None}):
        assert dec.MERGE_IN_KERNEL is (not merge) and dec.choose_num_splits is None
    assert dec.MERGE_IN_KERNEL is merge and dec.choose_num_splits is choose
