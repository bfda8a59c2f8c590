"""bench/bwd_order.py's dispatch model: a causal backward dealt in head order ends ragged; the
lighter half of every head last, or the last heads dealt key block by key block, bring it near
balance, and every order dispatches each program once."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("_bench_bwd_order", BENCH / "bwd_order.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.path.remove(str(BENCH))


@pytest.mark.parametrize("order", ["head", "lighter_half_last", "last_heads_by_block"])
def test_every_order_dispatches_each_key_block_of_each_head_once(bench, order):
    assert Counter(bench.dispatch(7, 5, order, tail=2)) == Counter({j: 5 for j in range(7)})


@pytest.mark.parametrize("n_kb, n_bh, tail", [(8, 256, 32), (32, 64, 8), (16, 64, 8)])
def test_head_order_ends_ragged_and_both_other_orders_near_balance(bench, n_kb, n_bh, tail):
    assert bench.model_overhang(n_kb, n_bh, "head") > 1.06
    assert bench.model_overhang(n_kb, n_bh, "lighter_half_last") < 1.013
    assert bench.model_overhang(n_kb, n_bh, "last_heads_by_block", tail) < 1.04


def test_a_grid_of_one_wave_is_bounded_by_its_longest_program(bench):
    # 4 programs on 132 SMs: the call lasts as long as key block 0's program, whatever the order
    cost0 = 2 * 4 + 1
    expected = cost0 / (sum(2 * (4 - j) + 1 for j in range(4)) / 132)
    for order in ("head", "lighter_half_last", "last_heads_by_block"):
        assert bench.model_overhang(4, 1, order) == pytest.approx(expected)


def test_an_unknown_order_is_refused_by_name(bench):
    with pytest.raises(ValueError, match="last_heads_by_block"):
        bench.dispatch(4, 1, "reverse")


def test_the_l2_model_reads_each_block_once_in_head_order_and_again_when_heads_run_apart(bench):
    # head_dim 256 at 4k: 16 heads x 4 batches of Q and dO, 64 query blocks of 128 KB each
    # (64 rows x 256 x 2 bytes x 2 tensors): 268 MB read once in head order; the lighter halves
    # run apart from their heads and read them again (the order measured 0.74x there)
    args = dict(seqlen=4096, head_dim=256, group=1, key_block=64)
    once = 64 * 64 * 64 * 256 * 2 * 2 / 1e6
    assert bench.model_hbm_mb(64, 64, "head", 4, **args) == pytest.approx(once)
    assert bench.model_hbm_mb(64, 64, "last_heads_by_block", 4, **args) == pytest.approx(once)
    assert bench.model_hbm_mb(64, 64, "lighter_half_last", 4, **args) > 5 * once


def test_the_l2_model_reads_everything_from_memory_when_nothing_fits(bench):
    # a cache smaller than one block: every read misses, in every order
    reads = sum(8 - 2 * j for j in range(4)) * 3  # 8 query blocks, 4 key blocks of 128, 3 heads
    unit = 64 * 64 * 2 * 2 / 1e6
    for order in ("head", "lighter_half_last", "last_heads_by_block"):
        assert bench.model_hbm_mb(4, 3, order, 1, seqlen=512, head_dim=64, group=1,
                                  l2_bytes=1) == pytest.approx(reads * unit)
