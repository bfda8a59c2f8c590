"""bench/fault_variants.py: each variant runs in its own process and its outcome, ok or the
error the call raised, lands in the results table (checked on the CPU through Triton's
interpreter, at the script's --smoke sizes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))  # bench/ is not a package

import fault_variants  # noqa: E402


def test_a_variant_that_raises_is_recorded_with_its_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the child inherits it
    outcome = fault_variants._child({"config": [48, 64, 4, 3]}, smoke=True)  # BLOCK_M not a power of 2
    assert outcome["outcome"] == "error"
    assert "power of 2" in outcome["error"]


def test_the_smoke_run_writes_one_row_per_variant(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(BENCH.parent))
    subprocess.run([sys.executable, str(BENCH / "fault_variants.py"), "--smoke", "--out", str(tmp_path),
                    "--commit", "test"], env=env, check=True, capture_output=True, timeout=600)
    data = json.loads((tmp_path / "fault_variants.json").read_text())
    assert len(data["rows"]) == len(fault_variants.SMOKE_VARIANTS)
    assert [r["outcome"] for r in data["rows"]] == ["ok"] * len(fault_variants.SMOKE_VARIANTS)
    assert data["rows"][0]["loops"] == "one (forced)" and data["rows"][1]["loops"] == "as shipped"
    assert "| the case as is | one (forced) | ok |" in (tmp_path / "fault_variants.md").read_text()
