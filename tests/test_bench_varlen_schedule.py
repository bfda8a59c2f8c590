"""bench/varlen_schedule.py's dispatch model: balance is 1.0, and the orders it compares are
ranked as a greedy scheduler ranks them."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))  # bench/ is not a package

import varlen_schedule as vs  # noqa: E402


def test_equal_tiles_filling_whole_waves_finish_together():
    assert vs.makespan([2.0] * (3 * vs.SMS)) == 6.0
    assert vs.round_robin([2.0] * (3 * vs.SMS)) == 6.0


def test_one_long_tile_last_is_the_tail_longest_first_avoids():
    costs = [1.0] * vs.SMS + [10.0]
    assert vs.makespan(costs) == 11.0
    assert vs.makespan(sorted(costs, reverse=True)) == 10.0


def test_a_snake_deal_evens_out_what_round_robin_leaves_on_the_first_programs():
    costs = sorted([float(i % 7 + 1) for i in range(4 * vs.SMS)], reverse=True)
    assert vs.snake([2.0] * (3 * vs.SMS)) == 6.0
    assert vs.snake(costs) < vs.round_robin(costs)


def test_tiles_cost_their_key_blocks_and_nothing_past_the_sequence():
    assert vs.tile_cost(300, 0, causal=False) == 3 + vs.TILE_EXTRA
    assert vs.tile_cost(300, 0, causal=True) == 1 + vs.TILE_EXTRA
    assert vs.tile_cost(300, 3, causal=True) == vs.DEAD


def test_the_packed_rows_are_near_balance_and_a_fixed_deal_is_not():
    r = vs.row([3000, 200, 1500, 700], causal=True)
    assert 1.0 <= r["longest_first"] <= r["program_order"] < r["persistent_round_robin"]
    assert r["persistent_sorted_snake"] < r["persistent_round_robin"]
