"""The interpreter's bounds checks that every kernel test runs under (``interpreter_bounds``)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from flash_ref import load_flash_attn2
from interpreter_bounds import caused_by_out_of_bounds, within_arguments

fa = load_flash_attn2()


@triton.jit
def _copy(X, Y, n, limit, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < limit, other=0.0)
    tl.store(Y + offs, x, mask=offs < n)


def test_kernel_tests_run_bounds_checked(_bounds_checked):
    q = torch.randn(1, 4, 2, 16)
    fa.flash_attn_func(q, q, q, causal=True)
    assert _bounds_checked is not None and _bounds_checked["accesses"] > 0


def test_masked_off_lanes_are_not_checked():
    x, y = torch.arange(8, dtype=torch.float32), torch.zeros(8)
    with within_arguments():
        _copy[(1,)](x, y, 8, 8, BLOCK=16)  # lanes 8..15 point past both tensors, masked off
    assert torch.equal(x, y)


def test_a_read_past_the_end_is_caught():
    x, y = torch.arange(8, dtype=torch.float32), torch.zeros(16)
    with within_arguments(), pytest.raises(Exception) as raised:
        _copy[(1,)](x, y, 16, 16, BLOCK=16)
    assert caused_by_out_of_bounds(raised.value)


def test_a_write_past_the_end_is_caught():
    x, y = torch.arange(16, dtype=torch.float32), torch.zeros(8)
    with within_arguments(), pytest.raises(Exception) as raised:
        _copy[(1,)](x, y, 16, 16, BLOCK=16)
    assert caused_by_out_of_bounds(raised.value)
