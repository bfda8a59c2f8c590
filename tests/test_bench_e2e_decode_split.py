"""bench/e2e_decode_split.py on the CPU: its smoke run (a tiny Llama in transformers, the shipped
kernel's decode under TRITON_INTERPRET=1) writes a row per contender, and its variant switch
acts on the decode module the bridge loaded and puts it back (figures meaningless here)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))  # bench/ is not a package

import e2e_decode_split  # noqa: E402
import harness  # noqa: E402


def test_the_smoke_run_times_every_contender_and_finds_the_decode_module(tmp_path):
    done = subprocess.run([sys.executable, str(BENCH / "e2e_decode_split.py"), "--smoke", "--out", str(tmp_path)],
                          env=harness.child_env(TRITON_INTERPRET="1", HF_HUB_OFFLINE="1"),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "e2e_decode_split.json").read_text())
    assert [r["attention"] for r in data["rows"]] == ["sdpa", "ours", "ours, capture query asked",
                                                     "ours, one slice", "ours, launcher key each call", "ours, timed by part"]
    for row in data["rows"]:
        assert row["decode_ms"] > 0 and row["host_us"] > 0, row
    # the clocked row splits its call into parts, each inside the bridge's whole call
    timed = data["rows"][-1]
    parts = dict(p.rsplit(" ", 1) for p in timed["parts"].split(" / "))
    assert 0 < float(parts["_SPLIT"]) <= float(parts["decode_attention"]) <= timed["host_us"] * 1.5
    assert len(data["parts_us"]) == 3  # the warm-up round and the two timed ones
    # the variants had a module to act on: the copy of the decode the bridge itself loaded
    assert data["decode_modules"] and all(n.endswith("._triton_decode") for n in data["decode_modules"])


def test_a_variant_changes_the_loaded_decode_and_reset_puts_it_back():
    fa = harness.shipped_kernel()
    dec = importlib.import_module(fa.__name__ + "._triton_decode")
    merge, choose, capturing, keep = dec.MERGE_IN_KERNEL, dec.choose_num_splits, dec._capturing, dec.KEEP_LAUNCHES
    variant = e2e_decode_split._Variant()
    try:
        variant.set("capture query asked")
        assert dec._capturing is not capturing and dec.MERGE_IN_KERNEL == merge
        variant.set("two kernels")
        assert dec.MERGE_IN_KERNEL is False and dec.choose_num_splits is choose
        variant.set("one slice")  # the previous variant is undone first
        assert dec.MERGE_IN_KERNEL == merge
        assert dec.choose_num_splits(10_000, 1 << 20, 132, True, 64) == 1
        variant.set("launcher key each call")
        assert dec.KEEP_LAUNCHES is False and dec.choose_num_splits is choose
    finally:
        variant.reset()
    assert dec.MERGE_IN_KERNEL == merge and dec.choose_num_splits is choose and dec.KEEP_LAUNCHES is keep
    assert dec._capturing is capturing
    assert choose(4, 1 << 16, 132, True, 64) > 1  # the real rule splits a long row of few programs
