"""Custom mask functions on FlashAttention (and sdpa's is_causal shortcut), decided by evaluation."""

from __future__ import annotations

import warnings

import pytest
import torch

from kernel_loader.attention import (
    and_masks,
    causal_mask_function,
    chunked_causal_mask_function,
    create_causal_mask,
    create_sliding_window_causal_mask,
    flash_attention_mask,
    sdpa_mask,
)
from kernel_loader.attention import mask_equivalence
from kernel_loader.errors import UnsupportedAttentionOptionError

from .conftest import grid


@pytest.fixture(autouse=True)
def fresh_answers():
    mask_equivalence.clear_answers()
    yield
    mask_equivalence.clear_answers()


def exactly_causal(b, h, q, kv):
    return kv <= q


def test_a_users_causal_predicate_is_accepted():
    assert flash_attention_mask(2, 5, 5, mask_function=exactly_causal) is None
    pad = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert flash_attention_mask(2, 5, 5, mask_function=exactly_causal, attention_mask=pad).tolist() == pad.bool().tolist()


def test_a_predicate_that_changes_the_result_names_the_first_cell_and_the_backends():
    def skip_key_one(b, h, q, kv):
        return kv != 1

    with pytest.raises(UnsupportedAttentionOptionError) as info:
        flash_attention_mask(1, 4, 4, mask_function=and_masks(causal_mask_function, skip_key_one))
    message = str(info.value)
    assert "batch row 0, query 1, key 1" in message and "is masked" in message and "attends" in message
    assert "'sdpa', 'eager' or 'flex_attention'" in message and "['custom']" in message


def test_through_the_builder_a_redundant_and_mask_function_is_fine(attn):
    cfg = attn.config("flash_attention_2")
    x = torch.zeros(1, 6, 8)
    assert create_causal_mask(cfg, x, None, and_mask_function=exactly_causal) is None
    with pytest.raises(UnsupportedAttentionOptionError, match="query 0, key 1"):
        create_causal_mask(cfg, x, None, or_mask_function=lambda b, h, q, kv: kv < 2)


def test_cells_of_padding_do_not_count():
    def from_key_two(b, h, q, kv):
        return kv >= 2

    pattern = and_masks(causal_mask_function, from_key_two)
    both_left_padded = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 1, 1, 1]])
    assert flash_attention_mask(2, 5, 5, mask_function=pattern, attention_mask=both_left_padded) is not None
    one_left_padded = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with pytest.raises(UnsupportedAttentionOptionError, match="batch row 1, query 0, key 0"):
        flash_attention_mask(2, 5, 5, mask_function=pattern, attention_mask=one_left_padded)


def test_offsets_are_the_real_positions():
    # two new queries after 6 cached keys: "kv <= q" is causal on absolute positions
    assert flash_attention_mask(1, 2, 8, q_offset=6, mask_function=exactly_causal) is None
    with pytest.raises(UnsupportedAttentionOptionError, match="query 6, key 7"):
        flash_attention_mask(1, 2, 8, q_offset=6, mask_function=lambda b, h, q, kv: kv <= q + 1)


def test_the_kernels_pattern_keeps_what_it_knows(attn):
    # sliding window + a predicate that only restates it: the kernel's window does the same
    cfg = attn.config("flash_attention_2", sliding_window=3)
    x = torch.zeros(1, 6, 8)
    restated = lambda b, h, q, kv: q - kv < 3  # noqa: E731
    assert create_sliding_window_causal_mask(cfg, x, None, and_mask_function=restated) is None
    with pytest.raises(UnsupportedAttentionOptionError, match="causal\\+sliding_window"):
        create_sliding_window_causal_mask(cfg, x, None, and_mask_function=lambda b, h, q, kv: q - kv < 2)


def test_chunks_are_fine_while_the_keys_fit_in_one():
    assert flash_attention_mask(1, 4, 4, mask_function=chunked_causal_mask_function(4)) is None
    with pytest.raises(UnsupportedAttentionOptionError, match="\\['chunked'\\].*query 4, key 0"):
        flash_attention_mask(1, 8, 8, mask_function=chunked_causal_mask_function(4))


def test_a_wholly_custom_pattern_is_compared_with_the_configs_causality(attn):
    everything = lambda b, h, q, kv: q >= 0  # noqa: E731
    encoder = attn.config("flash_attention_2", is_causal=False)
    assert flash_attention_mask(1, 3, 3, mask_function=everything, config=encoder) is None
    with pytest.raises(UnsupportedAttentionOptionError, match="query 0, key 1"):
        flash_attention_mask(1, 3, 3, mask_function=everything, config=attn.config("flash_attention_2"))


def test_the_answer_is_cached_per_function_and_shape():
    calls = []

    def counting(b, h, q, kv):
        calls.append(q.shape)
        return kv <= q

    for _ in range(3):
        flash_attention_mask(1, 4, 4, mask_function=counting)
    assert len(calls) == 1
    flash_attention_mask(1, 5, 5, mask_function=counting)
    assert len(calls) == 2


def test_past_the_budget_rows_are_sampled_and_the_assumption_is_said_once():
    def wrong_on_row_three(b, h, q, kv):
        return (kv <= q) & ~((q == 3) & (kv == 0))

    with pytest.warns(UserWarning, match="2 of 8 query rows.*assumed to agree"):
        assert flash_attention_mask(1, 8, 8, mask_function=wrong_on_row_three, mask_check_cells=16) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flash_attention_mask(1, 9, 9, mask_function=wrong_on_row_three, mask_check_cells=18)  # warned already
    # within the budget the same function is caught
    with pytest.raises(UnsupportedAttentionOptionError, match="query 3, key 0"):
        flash_attention_mask(1, 8, 8, mask_function=wrong_on_row_three)
    # the sample holds the first and the last row
    with pytest.raises(UnsupportedAttentionOptionError, match="query 7, key 0"):
        flash_attention_mask(1, 8, 8, mask_function=lambda b, h, q, kv: (kv <= q) & ~((q == 7) & (kv == 0)),
                             mask_check_cells=16)


def test_sdpa_is_causal_shortcut_is_taken_only_for_a_causal_pattern():
    assert sdpa_mask(1, 4, 4, mask_function=exactly_causal) is None
    not_causal = lambda b, h, q, kv: kv != 1  # noqa: E731
    mask = sdpa_mask(1, 4, 4, mask_function=not_causal)
    assert torch.equal(mask[0, 0], grid(["1011", "1011", "1011", "1011"]))
