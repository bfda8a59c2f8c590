"""Mask predicates and their combinators, checked cell by cell on small cases."""

from __future__ import annotations

import pytest
import torch

from kernel_loader.attention import (
    and_masks,
    bidirectional_mask_function,
    causal_mask_function,
    chunked_causal_mask_function,
    find_packed_sequence_indices,
    materialize_mask,
    or_masks,
    padding_mask_function,
    sliding_window_causal_mask_function,
)
from kernel_loader.attention.mask_functions import mask_kinds

from .conftest import grid


def dense(fn, q=5, kv=5, b=1, q_offset=0, padding=None):
    return materialize_mask(b, q, kv, q_offset, 0, fn, padding)[:, 0]


def test_causal_cells():
    assert torch.equal(dense(causal_mask_function)[0], grid(["10000", "11000", "11100", "11110", "11111"]))


def test_bidirectional_cells():
    assert bool(dense(bidirectional_mask_function).all())


def test_sliding_window_cells():
    # window 3: a query sees itself and the two keys before it
    expected = grid(["10000", "11000", "11100", "01110", "00111"])
    assert torch.equal(dense(sliding_window_causal_mask_function(3))[0], expected)


def test_chunked_cells_and_left_padding():
    expected = grid(["10000", "11000", "11100", "00010", "00011"])
    assert torch.equal(dense(chunked_causal_mask_function(3))[0], expected)
    # two tokens of left padding move the chunk start to position 2
    shifted = dense(chunked_causal_mask_function(3, torch.tensor([2])))[0]
    assert torch.equal(shifted, grid(["10000", "11000", "00100", "00110", "00111"]))


def test_padding_and_or_composition():
    pad = torch.tensor([[False, True, True, True, True]])
    both = and_masks(causal_mask_function, padding_mask_function(pad))
    assert torch.equal(dense(both)[0], grid(["00000", "01000", "01100", "01110", "01111"]))

    def first_key(b, h, q, kv):
        return kv == 0

    either = or_masks(sliding_window_causal_mask_function(2), first_key)
    assert torch.equal(dense(either)[0], grid(["10000", "11000", "11100", "10110", "10011"]))
    assert mask_kinds(either) >= {"or", "custom", "causal", "sliding_window"}


def test_and_or_refuse_non_callables():
    with pytest.raises(TypeError):
        and_masks(causal_mask_function, 3)
    with pytest.raises(TypeError):
        or_masks()


def test_find_packed_sequence_indices():
    pos = torch.tensor([[0, 1, 0, 1, 2, 0]])
    assert find_packed_sequence_indices(pos).tolist() == [[0, 0, 1, 1, 1, 2]]
    assert find_packed_sequence_indices(torch.arange(6)[None]) is None
