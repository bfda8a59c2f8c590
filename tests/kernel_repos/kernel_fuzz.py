"""What the shipped kernel's fuzz tests share: their budgets, the pair of tests each target gets
(a few examples in the normal suite, the long budget under ``-m fuzz``), and the long run's
report, ``bench/results/kernel_fuzz.{md,json}`` (written by ``conftest.py`` at the end of a
session that ran a long target and passed)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, given, settings

ROOT = Path(__file__).resolve().parents[2]
SMALL = 8  # examples per target in the normal suite (seconds)
LONG = int(os.environ.get("KERNEL_LOADER_FUZZ_EXAMPLES", "300"))  # per target under -m fuzz
RUNS: dict[str, dict[str, Any]] = {}  # long-run target -> examples run, seconds


def fuzz_tests(run: Callable[[dict], None], strategy: Any, target: str) -> tuple[Callable, Callable]:
    """(the suite's test, the long test) of ``run`` over examples drawn from ``strategy``."""

    @settings(max_examples=SMALL, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
    @given(call=strategy)
    def small(call):
        run(call)

    @pytest.mark.fuzz
    @settings(max_examples=LONG, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(call=strategy)
    def long(call):
        start = time.perf_counter()
        run(call)
        entry = RUNS.setdefault(target, {"target": target, "examples": 0, "seconds": 0.0})
        entry["examples"] += 1
        entry["seconds"] += time.perf_counter() - start

    return small, long


def write_report() -> Path:
    """``bench/results/kernel_fuzz.{md,json}`` from the long run's counts."""
    sys.path.insert(0, str(ROOT / "bench"))
    import harness

    rows = [dict(entry, seconds=round(entry["seconds"], 1)) for entry in RUNS.values()]
    return harness.write_results(
        "kernel_fuzz", rows, title="Fuzzing the shipped kernel under the interpreter, bounds-checked",
        columns=dict(target="target", examples="examples passed", seconds="seconds"),
        out_dir=ROOT / "bench" / "results",
        notes=["Every example ran under TRITON_INTERPRET=1 with each load and store checked against the "
               "launch's tensors (tests/kernel_repos/interpreter_bounds.py) and its output compared with "
               "the float64 reference; a session that fails writes no report. Out-of-bounds accesses "
               "found: 0; mismatches: 0."])
