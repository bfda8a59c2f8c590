"""bench/bwd_light_last.py's dispatch model: a causal backward dealt in head order ends ragged,
and the lighter half of every head's key blocks dealt last brings it near balance."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def bench(request):
    import sys

    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("_bench_bwd_light_last", BENCH / "bwd_light_last.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.path.remove(str(BENCH))


@pytest.mark.parametrize("n_kb, n_bh", [(8, 256), (32, 64), (16, 64)])
def test_head_order_ends_ragged_and_the_lighter_half_last_near_balance(bench, n_kb, n_bh):
    assert bench.model_overhang(n_kb, n_bh, False) > 1.06
    assert bench.model_overhang(n_kb, n_bh, True) < 1.013


def test_a_grid_of_one_wave_is_bounded_by_its_longest_program(bench):
    # 4 programs on 132 SMs: the call lasts as long as key block 0's program, whatever the order
    cost0 = 2 * 4 + 1
    assert bench.model_overhang(4, 1, False) == bench.model_overhang(4, 1, True) == pytest.approx(
        cost0 / (sum(2 * (4 - j) + 1 for j in range(4)) / 132))
