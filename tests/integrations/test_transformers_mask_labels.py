"""transformers' own builders, through the bridge's adapted formatters: labels and evaluation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kernel_loader.attention import flash_attention_mask
from kernel_loader.errors import UnsupportedAttentionOptionError

masking_utils = pytest.importorskip("transformers.masking_utils")

from kernel_loader.integrations.transformers.mask_labels import adapt_mask_formatter, describer_for  # noqa: E402

NAME = "kernel-loader-test/flash-formatter"


@pytest.fixture
def flash_name():
    registry = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    registry[NAME] = adapt_mask_formatter(flash_attention_mask, describer_for(masking_utils), "5")
    yield SimpleNamespace(_attn_implementation=NAME)
    registry.pop(NAME, None)


_ON_4 = __import__("transformers").__version__.startswith("4.")
#: These paths are verified on transformers 5.17-5.25; 4.57 differs (see docs/transformers.md).
needs_transformers_5 = pytest.mark.skipif(_ON_4, reason="transformers 4.57 lacks this 5.x path: its mask builders take other arguments (no block_sequence_ids, packed-sequence helpers)")

@needs_transformers_5
def test_transformers_closures_are_labelled_with_their_parameters():
    describe = describer_for(masking_utils).describe
    window = describe(masking_utils.sliding_window_causal_mask_function(4))
    assert window.mask_kind == "and"
    assert {part.mask_kind for part in window.mask_params["parts"]} == {"sliding_window", "causal"}
    positions = torch.tensor([[0, 1, 0, 1]])
    remap = describe(masking_utils.remap_positions_for_packed_sequence(masking_utils.causal_mask_function, positions))
    assert remap.mask_kind == "remap" and remap.mask_params["position_ids"] is positions
    users = lambda b, h, q, kv: kv <= q  # noqa: E731
    assert describe(users) is users  # a user's predicate stays unlabelled: "custom"


@needs_transformers_5
def test_transformers_builder_with_a_redundant_predicate_runs_on_flash(flash_name):
    x = torch.zeros(2, 5, 8)
    pad = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    mask = masking_utils.create_causal_mask(flash_name, x, pad, None, and_mask_function=lambda b, h, q, kv: kv <= q)
    assert mask.tolist() == pad.bool().tolist()


@needs_transformers_5
def test_transformers_builder_with_a_block_overlay_is_refused_on_flash(flash_name):
    x = torch.zeros(1, 4, 8)
    blocks = torch.tensor([[-1, 0, 0, -1]])  # tokens 1 and 2 see each other: not causal
    with pytest.raises(UnsupportedAttentionOptionError, match="query 1, key 2"):
        masking_utils.create_causal_mask(flash_name, x, None, None, block_sequence_ids=blocks)
    single = torch.tensor([[-1, 0, -1, -1]])  # a block of one token changes nothing
    assert masking_utils.create_causal_mask(flash_name, x, None, None, block_sequence_ids=single) is None


def test_the_457_flavour_turns_cache_position_into_query_sizes():
    seen = {}

    def formatter(**kwargs):
        seen.update(kwargs)

    adapted = adapt_mask_formatter(formatter, describer_for(masking_utils), "4.57")
    adapted(batch_size=1, cache_position=torch.arange(3, 5), kv_length=5, mask_function=masking_utils.causal_mask_function)
    assert (seen["q_length"], seen["q_offset"]) == (2, 3) and "cache_position" not in seen
    assert seen["mask_function"].mask_kind == "causal"
