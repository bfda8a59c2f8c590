"""bench/flash_attn_tests.py: the sample of flash-attention's parametrization it draws, and its
runner: a case that ends its worker's CUDA context (or kills the worker) is recorded as that
case's failure, and the cases queued after it still run, in a fresh process. The runner is played
on the CPU with stand-in cases (the real ones need a GPU)."""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))  # bench/ is not a package; spawned workers inherit this path

import flash_attn_tests  # noqa: E402


def no_kernel():
    return None


def stand_in(fa, case: dict) -> dict:
    """Passes, or fails the way a device fault does ("cuda"), or kills its process ("die")."""
    if case.get("crash") == "cuda":
        raise RuntimeError("CUDA error: misaligned address")
    if case.get("crash") == "die":
        os._exit(3)
    return dict(passed=True, pid=os.getpid())


def test_a_poisoned_or_dead_worker_does_not_hide_the_cases_after_it():
    cases = [{}, {"crash": "cuda"}, {}, {}, {"crash": "die"}, {}]
    jobs = [(i, "stand_in", c) for i, c in enumerate(cases)]
    results = flash_attn_tests.run_cases(jobs, workers=1, deadline=240, load=no_kernel,
                                         runners={"stand_in": stand_in})
    assert [r["index"] for r in results] == list(range(6))
    assert [r["passed"] for r in results] == [True, False, True, True, False, True]
    assert "misaligned address" in results[1]["error"]
    assert "exit code 3" in results[4]["error"]
    # one process up to the CUDA error, a fresh one after it, another after the killed one
    assert results[0]["pid"] != results[2]["pid"] == results[3]["pid"] != results[5]["pid"]


def test_a_failure_names_the_innermost_frame_of_the_kernel_package():
    trace = ('Traceback (most recent call last):\n'
             '  File "/r/bench/flash_attn_tests.py", line 300, in _worker\n'
             '  File "/r/kernel_repos/x/flash_attn2/_autograd.py", line 220, in backward\n'
             '  File "/r/kernel_repos/x/flash_attn2/_triton_bwd.py", line 491, in launch\n'
             '  File "/r/site-packages/torch/cuda/__init__.py", line 9, in synchronize\n'
             'RuntimeError: CUDA error: misaligned address\n')
    assert flash_attn_tests._where(dict(trace=trace)) == " (raised at _triton_bwd.py:491 in launch)"
    assert flash_attn_tests._where(dict(error="x")) == ""


def test_a_fault_in_the_launch_helper_also_names_the_kernel_that_launched():
    trace = ('Traceback (most recent call last):\n'
             '  File "/r/kernel_repos/x/flash_attn2/_autograd.py", line 80, in forward\n'
             '  File "/r/kernel_repos/x/flash_attn2/_triton_fwd.py", line 424, in attention_forward\n'
             '  File "/r/kernel_repos/x/flash_attn2/_launch.py", line 191, in __call__\n'
             'RuntimeError: Triton Error [CUDA]: misaligned address\n')
    assert flash_attn_tests._where(dict(trace=trace)) == (
        " (raised at _launch.py:191 in __call__, launched from _triton_fwd.py:424 in attention_forward)")


def _pairs(cases: list, names: list) -> set:
    return {((a, json.dumps(c[a])), (b, json.dumps(c[b]))) for c in cases for a, b in itertools.combinations(names, 2)}


def test_each_sample_covers_every_pair_of_feature_values_and_every_head_dim():
    for samples in (1, 3):
        cases = flash_attn_tests.all_cases(samples)
        for family, factors in flash_attn_tests.FAMILIES.items():
            mine = [c for f, c in cases if f == family]
            paired = [n for n in factors if n not in flash_attn_tests.CYCLED]
            # every pair some upstream-runnable case holds (the pool pairwise() draws from)
            pool = [dict(zip(paired, vals)) for vals in itertools.product(*(factors[n] for n in paired))]
            pool = [c for c in pool if flash_attn_tests.runs_upstream(family, c)]
            assert _pairs(pool, paired) <= _pairs(mine, paired), family
            for name in set(factors) & set(flash_attn_tests.CYCLED):
                assert {json.dumps(c[name]) for c in mine} == {json.dumps(v) for v in factors[name]}, (family, name)


def test_more_samples_add_new_cases_and_keep_the_first_sample():
    one = flash_attn_tests.all_cases(1)
    three = flash_attn_tests.all_cases(3)
    keys = [json.dumps([f, c], sort_keys=True) for f, c in three]
    assert len(keys) == len(set(keys))  # no case twice
    assert {json.dumps([f, c], sort_keys=True) for f, c in one} < set(keys)
    assert len(three) > 2 * len(one)
    # every head dim meets other features in the later samples than in the first
    def features(cases):
        by_d = {}
        for f, c in cases:
            if f == "test_flash_attn_output":
                rest = {n: v for n, v in c.items() if n not in flash_attn_tests.CYCLED}
                by_d.setdefault(c["d"], set()).add(json.dumps(rest, sort_keys=True))
        return by_d
    first, all_three = features(one), features(three)
    assert all(len(all_three[d]) > len(first[d]) for d in flash_attn_tests.HEAD_DIMS)
