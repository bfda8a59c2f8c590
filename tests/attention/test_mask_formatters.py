"""The per-backend formatters on their own: what each returns, when it may skip, what it refuses."""

from __future__ import annotations

import pytest
import torch

from kernel_loader.attention import (
    causal_mask_function,
    chunked_causal_mask_function,
    create_chunked_causal_mask,
    create_causal_mask,
    eager_mask,
    flash_attention_mask,
    flex_attention_mask,
    implicit_mask,
    or_masks,
    paged_attention_mask,
    sdpa_mask,
    sliding_window_causal_mask_function,
)
from kernel_loader.errors import UnsupportedAttentionOptionError


def test_sdpa_mask_static_cache_prefill_skips():
    # empty cache, 3 real tokens, 2 future slots: top-left is_causal is exact
    pad = torch.tensor([[1, 1, 1, 0, 0]], dtype=torch.bool)
    assert sdpa_mask(1, 3, 5, attention_mask=pad) is None
    # with a cache offset the skip is not allowed
    m = sdpa_mask(1, 2, 5, q_offset=3, attention_mask=torch.ones(1, 5, dtype=torch.bool))
    assert m is not None and m[0, 0].tolist() == [[True] * 4 + [False], [True] * 5]


def test_sdpa_mask_window_prevents_skip():
    assert sdpa_mask(1, 4, 4, local_size=8, mask_function=sliding_window_causal_mask_function(8)) is None
    m = sdpa_mask(1, 4, 4, local_size=2, mask_function=sliding_window_causal_mask_function(2))
    assert m[0, 0, 3].tolist() == [False, False, True, True]


def test_eager_mask_dtype_and_values():
    m = eager_mask(1, 2, 2, dtype=torch.float16)
    assert m.dtype == torch.float16
    assert m[0, 0].tolist() == [[0.0, torch.finfo(torch.float16).min], [0.0, 0.0]]


def test_flash_mask_refuses_patterns_it_cannot_apply():
    def custom(b, h, q, kv):
        return kv != 1

    with pytest.raises(UnsupportedAttentionOptionError, match="sdpa"):
        flash_attention_mask(1, 4, 4, mask_function=or_masks(causal_mask_function, custom))
    with pytest.raises(UnsupportedAttentionOptionError, match="chunked"):
        flash_attention_mask(1, 8, 8, mask_function=chunked_causal_mask_function(4))
    # a single chunk is just causal
    assert flash_attention_mask(1, 4, 4, mask_function=chunked_causal_mask_function(4)) is None
    assert flash_attention_mask(1, 4, 4, mask_function=sliding_window_causal_mask_function(2)) is None


def test_flash_mask_through_builder_refuses_chunks(attn):
    x = torch.zeros(1, 6, 8)
    with pytest.raises(UnsupportedAttentionOptionError):
        create_chunked_causal_mask(attn.config("flash_attention_2", attention_chunk_size=2), x, None)

    def custom(b, h, q, kv):
        return kv > 0

    with pytest.raises(UnsupportedAttentionOptionError):
        create_causal_mask(attn.config("flash_attention_2"), x, None, and_mask_function=custom)


def test_flash_mask_slices_to_kv_length():
    pad = torch.tensor([[0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    m = flash_attention_mask(1, 1, 4, q_offset=5, attention_mask=pad)
    assert m is None  # the last 4 keys are all real
    m = flash_attention_mask(1, 1, 5, attention_mask=pad)
    assert m.tolist() == [[False, True, True, True, True]]


def test_flex_mask_with_offsets_and_padding():
    pad = torch.tensor([[0, 1, 1, 1]], dtype=torch.bool)
    bm = flex_attention_mask(1, 2, 4, q_offset=2, attention_mask=pad)
    b, q, kv = torch.meshgrid(torch.arange(1), torch.arange(2), torch.arange(4), indexing="ij")
    cells = bm.mask_mod(b, torch.zeros_like(b), q, kv)
    assert cells[0].tolist() == [[False, True, True, False], [False, True, True, True]]


def test_paged_mask_is_none():
    assert paged_attention_mask(2, 3, 4, attention_mask=torch.ones(2, 4)) is None


def test_implicit_mask_conventions():
    assert implicit_mask(1, 5, True) is None  # decoding sees every key
    assert implicit_mask(3, 3, False) is None
    m = implicit_mask(3, 3, True)[0, 0]
    assert m.tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    m = implicit_mask(1, 5, True, sliding_window=2)[0, 0]
    assert m.tolist() == [[False, False, False, True, True]]
