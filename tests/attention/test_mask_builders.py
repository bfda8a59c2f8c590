"""The create_* builders: each backend's format, padding, caches, packed sequences, pitfalls."""

from __future__ import annotations

import warnings

import pytest
import torch

from kernel_loader.attention import (
    create_bidirectional_mask,
    create_bidirectional_sliding_window_mask,
    create_causal_mask,
    create_chunked_causal_mask,
    create_sliding_window_causal_mask,
)
from kernel_loader.attention import mask_builders

from .conftest import grid


def test_create_causal_sdpa_skips_when_is_causal_suffices(attn):
    x = torch.zeros(2, 5, 8)
    assert create_causal_mask(attn.config("sdpa"), x, None) is None
    assert create_causal_mask(attn.config("sdpa"), x, torch.ones(2, 5)) is None
    m = create_causal_mask(attn.config("sdpa"), x, None, allow_is_causal_skip=False)
    assert torch.equal(m[0, 0], grid(["10000", "11000", "11100", "11110", "11111"]))


def test_create_causal_left_and_right_padding_each_backend(attn):
    x = torch.zeros(2, 4, 8)
    pad = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0]])
    expected = torch.stack(
        [grid(["0000", "0000", "0010", "0011"]), grid(["1000", "1100", "1110", "1110"])]
    )
    sd = create_causal_mask(attn.config("sdpa"), x, pad)
    assert sd.shape == (2, 1, 4, 4) and torch.equal(sd[:, 0], expected)
    ea = create_causal_mask(attn.config("eager"), x, pad)
    assert ea.dtype == x.dtype
    assert torch.equal(ea[:, 0] == 0, expected)
    assert bool((ea[:, 0][~expected] == torch.finfo(torch.float32).min).all())
    fl = create_causal_mask(attn.config("flash_attention_2"), x, pad)
    assert fl.shape == (2, 4) and torch.equal(fl, pad.bool())
    assert create_causal_mask(attn.config("flash_attention_2"), x, torch.ones(2, 4)) is None
    bm = create_causal_mask(attn.config("flex_attention"), x, pad)
    assert bm.shape[-2:] == (4, 4)
    # BlockMask keeps the mask_mod: evaluate it on every cell
    b, q, kv = torch.meshgrid(torch.arange(2), torch.arange(4), torch.arange(4), indexing="ij")
    assert torch.equal(bm.mask_mod(b, torch.zeros_like(b), q, kv), expected)


def test_create_causal_with_cache_offset(attn):
    # 3 tokens cached, 2 new: queries sit at positions 3 and 4
    x = torch.zeros(1, 2, 8)
    m = create_causal_mask(attn.config("eager"), x, None, past_key_values_length=3)
    assert torch.equal(m[0, 0] == 0, grid(["11110", "11111"]))


def test_decode_with_transformers_cache(attn):
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.update(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4), 0)
    x = torch.zeros(1, 1, 8)
    pad = torch.tensor([[0, 1, 1, 1]])
    m = create_causal_mask(attn.config("sdpa"), x, pad, cache)
    assert torch.equal(m[0, 0], grid(["0111"]))


def test_is_causal_false_gives_bidirectional(attn):
    x = torch.zeros(1, 3, 8)
    pad = torch.tensor([[1, 1, 0]])
    m = create_causal_mask(attn.config("sdpa", is_causal=False), x, pad)
    assert torch.equal(m[0, 0], grid(["110", "110", "110"]))
    assert create_bidirectional_mask(attn.config("sdpa"), x, None) is None
    m = create_bidirectional_mask(attn.config("eager"), x, pad)
    assert torch.equal(m[0, 0] == 0, grid(["110", "110", "110"]))


def test_bidirectional_sliding_window(attn):
    x = torch.zeros(1, 5, 8)
    m = create_bidirectional_sliding_window_mask(attn.config("sdpa", sliding_window=1), x, None)
    assert torch.equal(m[0, 0], grid(["11000", "11100", "01110", "00111", "00011"]))


def test_sliding_and_chunked_builders(attn):
    x = torch.zeros(1, 5, 8)
    m = create_sliding_window_causal_mask(attn.config("sdpa", sliding_window=2), x, None)
    assert torch.equal(m[0, 0], grid(["10000", "11000", "01100", "00110", "00011"]))
    # window longer than the sequence: plain causal, sdpa may use is_causal
    assert create_sliding_window_causal_mask(attn.config("sdpa", sliding_window=8), x, None) is None
    m = create_chunked_causal_mask(attn.config("sdpa", attention_chunk_size=2), x, None)
    assert torch.equal(m[0, 0], grid(["10000", "11000", "00100", "00110", "00001"]))
    with pytest.raises(ValueError, match="sliding_window"):
        create_sliding_window_causal_mask(attn.config("sdpa"), x, None)
    with pytest.raises(ValueError, match="attention_chunk_size"):
        create_chunked_causal_mask(attn.config("sdpa"), x, None)


def test_packed_sequences_from_position_ids(attn):
    x = torch.zeros(1, 5, 8)
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    m = create_causal_mask(attn.config("sdpa"), x, None, position_ids=pos)
    assert torch.equal(m[0, 0], grid(["10000", "11000", "11100", "00010", "00011"]))
    # the window restarts with each packed sequence
    m = create_sliding_window_causal_mask(attn.config("sdpa", sliding_window=2), x, None, position_ids=pos)
    assert torch.equal(m[0, 0], grid(["10000", "11000", "01100", "00010", "00011"]))


def test_and_or_mask_function_arguments(attn):
    x = torch.zeros(1, 4, 8)

    def image_block(b, h, q, kv):
        return (q < 2) & (kv < 2)

    m = create_causal_mask(attn.config("sdpa"), x, None, or_mask_function=image_block)
    assert torch.equal(m[0, 0], grid(["1100", "1100", "1110", "1111"]))

    def no_first(b, h, q, kv):
        return kv > 0

    m = create_causal_mask(attn.config("sdpa"), x, None, and_mask_function=no_first)
    assert torch.equal(m[0, 0], grid(["0000", "0100", "0110", "0111"]))


def test_user_4d_masks_pass_through_untouched(attn):
    x = torch.zeros(1, 3, 8)
    bool_mask = torch.tensor([[[[True, False, True]] * 3]])
    float_mask = torch.zeros(1, 1, 3, 3)
    float_mask[..., 1] = float("-inf")
    for name in ("sdpa", "eager", "flash_attention_2", "flex_attention"):
        assert create_causal_mask(attn.config(name), x, bool_mask) is bool_mask
        assert create_causal_mask(attn.config(name), x, float_mask) is float_mask


def test_float_one_zero_mask_pitfall(attn):
    """A 4D float mask of 1/0 is additive: it hides nothing. We pass it on but warn."""
    from kernel_loader.attention import eager_attention_forward

    mask_builders._warned.discard("float-one-zero")
    case = attn.make_case(b=1, hq=2, hkv=2, sq=4)
    wrong = torch.tril(torch.ones(4, 4))[None, None]  # 1 = attend, 0 = "masked" (wrong convention)
    with pytest.warns(UserWarning, match="hides nothing"):
        passed = create_causal_mask(attn.config("eager"), torch.zeros(1, 4, 8), wrong)
    assert passed is wrong
    out_wrong, w_wrong = eager_attention_forward(attn.module(), case.q, case.k, case.v, passed)
    # key 3 still gets weight from query 0: the mask did not mask
    assert float(w_wrong[0, 0, 0, 3]) > 0
    right = torch.tril(torch.ones(4, 4, dtype=torch.bool))[None, None]
    out_right, w_right = eager_attention_forward(attn.module(), case.q, case.k, case.v, right)
    assert float(w_right[0, 0, 0, 3]) == 0
    assert not torch.allclose(out_wrong, out_right)
    fixed = (1.0 - wrong) * torch.finfo(torch.float32).min
    out_fixed, _ = eager_attention_forward(attn.module(), case.q, case.k, case.v, fixed)
    torch.testing.assert_close(out_fixed, out_right)


def test_backend_without_formatter_warns_once_and_returns_none(attn):
    mask_builders._warned.discard("no-formatter:custom_backend")
    x = torch.zeros(1, 3, 8)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert create_causal_mask(attn.config("custom_backend"), x, torch.tensor([[0, 1, 1]])) is None
        assert create_causal_mask(attn.config("custom_backend"), x, None) is None
    texts = [str(w.message) for w in seen if "custom_backend" in str(w.message)]
    assert len(texts) == 1
    assert "AttentionMaskInterface.register('custom_backend'" in texts[0]


def test_bad_mask_rank_raises(attn):
    with pytest.raises(ValueError, match="2D"):
        create_causal_mask(attn.config("sdpa"), torch.zeros(1, 3, 8), torch.ones(1, 1, 3))
