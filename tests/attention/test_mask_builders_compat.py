"""The builders take transformers' mask API keyword for keyword (4.57, 5.17-5.25) and mean the same.

Where transformers is installed its own builders are the oracle: the same call must give the
same tensor. The keyword lists of 4.57.0 and 5.17.0 were read from those releases'
``masking_utils.py`` (their ``create_*`` signatures); 5.25 added ``position_ids`` to the
bidirectional builders.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from kernel_loader.attention import mask_builders

from .conftest import grid

transformers_masks = pytest.importorskip("transformers.masking_utils")
DynamicCache = pytest.importorskip("transformers").DynamicCache

BUILDERS = [
    "create_causal_mask",
    "create_sliding_window_causal_mask",
    "create_chunked_causal_mask",
    "create_bidirectional_mask",
    "create_bidirectional_sliding_window_mask",
    "create_recurrent_attention_mask",
    "create_masks_for_generate",
]
CAUSAL_457 = {"config", "input_embeds", "attention_mask", "cache_position", "past_key_values", "position_ids",
              "or_mask_function", "and_mask_function"}
CAUSAL_517 = {"config", "inputs_embeds", "attention_mask", "past_key_values", "position_ids", "or_mask_function",
              "and_mask_function", "block_sequence_ids", "layer_idx", "allow_is_causal_skip"}
BIDIRECTIONAL_517 = {"config", "inputs_embeds", "attention_mask", "encoder_hidden_states", "past_key_values",
                     "or_mask_function", "and_mask_function", "allow_is_bidirectional_skip"}
BIDIRECTIONAL_525 = BIDIRECTIONAL_517 | {"position_ids"}
RELEASE_KEYWORDS = {
    "create_causal_mask": CAUSAL_457 | CAUSAL_517,
    "create_sliding_window_causal_mask": CAUSAL_457 | CAUSAL_517,
    "create_chunked_causal_mask": CAUSAL_457 | CAUSAL_517,
    "create_bidirectional_mask": BIDIRECTIONAL_525,
    "create_bidirectional_sliding_window_mask": BIDIRECTIONAL_525,
    "create_recurrent_attention_mask": {"config", "inputs_embeds", "attention_mask", "past_key_values"},
    "create_masks_for_generate": (CAUSAL_457 | CAUSAL_517) - {"layer_idx", "allow_is_causal_skip"},
}


def _named(fn) -> set[str]:
    return {p.name for p in inspect.signature(fn).parameters.values() if p.kind is not p.VAR_KEYWORD}


@pytest.mark.parametrize("name", BUILDERS)
def test_every_keyword_of_the_installed_transformers_is_accepted(name):
    theirs = _named(getattr(transformers_masks, name))
    assert theirs - _named(getattr(mask_builders, name)) == set()


@pytest.mark.parametrize("name", BUILDERS)
def test_every_keyword_of_457_and_517_is_accepted(name):
    assert RELEASE_KEYWORDS[name] - _named(getattr(mask_builders, name)) == set()


def _config(name="sdpa", **kw):
    cfg = SimpleNamespace(_attn_implementation=name, **kw)
    cfg.get_text_config = lambda: cfg
    return cfg


def _cache(batch=2, cached=4):
    cache = DynamicCache()
    cache.update(torch.zeros(batch, 1, cached, 8), torch.zeros(batch, 1, cached, 8), 0)
    return cache


PAD = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("builder", ["create_causal_mask", "create_sliding_window_causal_mask",
                                     "create_chunked_causal_mask"])
def test_past_key_values_is_cache_and_matches_transformers(backend, builder):
    cfg = _config(backend, sliding_window=3, attention_chunk_size=4)
    x = torch.zeros(2, 2, 8)
    ours = getattr(mask_builders, builder)(cfg, x, PAD, past_key_values=_cache())
    assert torch.equal(ours, getattr(mask_builders, builder)(cfg, x, PAD, cache=_cache()))
    assert torch.equal(ours, getattr(transformers_masks, builder)(cfg, x, PAD, _cache()))


def test_both_names_of_one_argument_must_agree():
    with pytest.raises(TypeError, match="cache and past_key_values"):
        mask_builders.create_causal_mask(_config(), torch.zeros(2, 2, 8), PAD, cache=_cache(), past_key_values=_cache())
    with pytest.raises(TypeError, match="needs inputs_embeds"):
        mask_builders.create_causal_mask(_config(), attention_mask=PAD)


def test_457_call_with_input_embeds_and_cache_position():
    # transformers 4.57 model code: keywords only, queries 3 and 4 of a 5-token row
    mask = mask_builders.create_causal_mask(
        config=_config(), input_embeds=torch.zeros(1, 2, 8), attention_mask=torch.ones(1, 5, dtype=torch.long),
        cache_position=torch.arange(3, 5), past_key_values=None, position_ids=None,
    )
    assert torch.equal(mask[0, 0], grid(["11110", "11111"]))


def test_block_sequence_ids_make_blocks_bidirectional_like_transformers():
    blocks = torch.tensor([[-1, 0, 0, -1], [1, 1, -1, -1]])
    x = torch.zeros(2, 4, 8)
    ours = mask_builders.create_causal_mask(_config(), x, None, None, block_sequence_ids=blocks)
    assert torch.equal(ours[0, 0], grid(["1000", "1110", "1110", "1111"]))  # tokens 1 and 2 see each other
    assert torch.equal(ours[1, 0], grid(["1100", "1100", "1110", "1111"]))
    assert torch.equal(ours, transformers_masks.create_causal_mask(_config(), x, None, None, block_sequence_ids=blocks))


class _HybridCache:
    """Layer 0 slides over 2 keys, layer 1 sees all 6: which one sizes the mask?"""

    is_sliding = [True, False]
    asked: list = []

    def get_mask_sizes(self, q_length, layer_idx):
        self.asked.append(layer_idx)
        return (2, 4) if layer_idx == 0 else (6, 0)

    def get_query_offset(self, layer_idx):
        return 4


def test_layer_idx_none_picks_the_first_layer_of_the_builders_kind():
    cache, cfg, x = _HybridCache(), _config("eager", sliding_window=2), torch.zeros(1, 2, 8)
    assert mask_builders.create_causal_mask(cfg, x, None, cache).shape[-1] == 6
    assert mask_builders.create_sliding_window_causal_mask(cfg, x, None, cache).shape[-1] == 2
    assert mask_builders.create_causal_mask(cfg, x, None, cache, layer_idx=0).shape[-1] == 2
    assert cache.asked == [1, 0, 0]


def test_config_is_causal_false_hands_the_skip_to_the_bidirectional_mask():
    cfg, x = _config(is_causal=False), torch.zeros(1, 3, 8)
    assert mask_builders.create_causal_mask(cfg, x, None) is None
    kept = mask_builders.create_causal_mask(cfg, x, None, allow_is_causal_skip=False)
    assert bool(kept.all())
    assert torch.equal(kept, transformers_masks.create_causal_mask(cfg, x, None, None, allow_is_causal_skip=False))


def test_bidirectional_cross_attention_sizes_from_the_encoder():
    enc = torch.zeros(2, 5, 8, dtype=torch.float64)
    pad = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    ours = mask_builders.create_bidirectional_mask(_config("eager"), torch.zeros(2, 3, 8), pad, encoder_hidden_states=enc)
    assert ours.shape == (2, 1, 3, 5) and ours.dtype == torch.float64
    assert torch.equal(ours, transformers_masks.create_bidirectional_mask(
        _config("eager"), torch.zeros(2, 3, 8), pad, encoder_hidden_states=enc))


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_bidirectional_packed_sequences_from_position_ids_like_transformers(backend):
    # two rows, each two sequences (positions restart); a window of 1 restarts with each of them
    pos = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]])
    x = torch.zeros(2, 5, 8)
    cfg = _config(backend, sliding_window=1)
    full = mask_builders.create_bidirectional_mask(cfg, x, None, position_ids=pos)
    window = mask_builders.create_bidirectional_sliding_window_mask(cfg, x, None, position_ids=pos)
    if backend == "eager":  # additive: 0 where allowed
        full, window = full == 0, window == 0
    assert torch.equal(full[0, 0], grid(["11100", "11100", "11100", "00011", "00011"]))
    assert torch.equal(full[1, 0], grid(["11000", "11000", "00111", "00111", "00111"]))
    assert torch.equal(window[0, 0], grid(["11000", "11100", "01100", "00011", "00011"]))
    # one sequence per row: nothing to mask, the skip stays allowed
    assert mask_builders.create_bidirectional_mask(cfg, x, None, position_ids=torch.arange(5)[None]) is None
    # a padding mask or a cache turns the detection off, as in transformers
    padded = mask_builders.create_bidirectional_mask(_config(), x, torch.ones(2, 5, dtype=torch.long), position_ids=pos)
    assert padded is None
    if "position_ids" in _named(transformers_masks.create_bidirectional_mask):  # 5.25 and later
        for name in ("create_bidirectional_mask", "create_bidirectional_sliding_window_mask"):
            theirs = getattr(transformers_masks, name)(cfg, x, None, position_ids=pos)
            assert torch.equal(getattr(mask_builders, name)(cfg, x, None, position_ids=pos), theirs)


def test_a_paged_cache_needs_no_mask():
    class PagedAttentionCache:  # continuous batching's cache, by name as transformers checks it
        pass

    assert mask_builders.create_causal_mask(_config(), torch.zeros(1, 3, 8), PAD[:1, :3], PagedAttentionCache()) is None


def test_chunked_decode_after_left_padding_matches_transformers():
    from transformers import LlamaConfig

    config = LlamaConfig(attention_chunk_size=4, attn_implementation="sdpa", num_hidden_layers=1)

    def filled_cache():  # 8 cached tokens in a chunked (sliding) layer
        cache = DynamicCache(config=config)
        kv = torch.zeros(2, 2, 8, 4)
        cache.update(kv, kv, 0)
        return cache

    pad = torch.tensor([[0] * 7 + [1, 1], [1] * 9])  # row 0: 7 tokens of left padding
    x = torch.zeros(2, 1, 8)
    ours = mask_builders.create_chunked_causal_mask(config, x, pad, past_key_values=filled_cache())
    # row 0's chunks start at its first real token (7), row 1's at 0: the new token 8 sees 7-8 / only 8
    assert ours[:, 0, 0].tolist() == [[False, False, True, True], [False, False, False, True]]
    assert torch.equal(ours, transformers_masks.create_chunked_causal_mask(config, x, pad, filled_cache()))


def test_recurrent_mask_is_the_padding_of_this_forward_or_none():
    x = torch.zeros(2, 3, 8)
    pad = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    build = mask_builders.create_recurrent_attention_mask
    assert build(_config(), x, None) is None
    assert build(_config(), x, torch.ones(2, 1, 3, 5)) is None  # a prepared 4D mask: no padding signal
    assert build(_config(), torch.zeros(2, 1, 8), pad) is None  # decode: a new token is never padding
    assert build(_config(), x, torch.ones(2, 5)) is None
    assert build(_config(), x, pad).tolist() == [[1, 1, 1], [1, 1, 1]]
    left = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert build(_config(), torch.zeros(2, 4, 8), left, past_key_values=None).tolist() == [[0, 1, 1, 1], [1, 1, 1, 1]]


def test_masks_for_generate_follow_layer_types():
    cfg = _config("eager", layer_types=["full_attention", "sliding_attention", "full_attention"], sliding_window=2)
    x = torch.zeros(2, 4, 8)
    masks = mask_builders.create_masks_for_generate(cfg, x, None, None)
    assert set(masks) == {"full_attention", "sliding_attention"}
    assert torch.equal(masks["full_attention"], mask_builders.create_causal_mask(cfg, x, None))
    assert torch.equal(masks["sliding_attention"], mask_builders.create_sliding_window_causal_mask(cfg, x, None))
    theirs = transformers_masks.create_masks_for_generate(cfg, x, None, None)
    assert all(torch.equal(masks[k], theirs[k]) for k in theirs)


def test_masks_for_generate_hybrid_and_unknown_layer_types():
    pad = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    hybrid = _config("eager", layer_types=["hybrid"])
    masks = mask_builders.create_masks_for_generate(hybrid, torch.zeros(2, 4, 8), pad, None)
    assert set(masks) == {"full_attention", "linear_attention"}
    assert masks["linear_attention"].tolist() == pad.tolist()
    unknown = _config("eager", layer_types=["full_attention", "something_new"])
    assert mask_builders.create_masks_for_generate(unknown, torch.zeros(2, 4, 8), pad, None) is pad
    # deferring needs no inputs at all
    assert mask_builders.create_masks_for_generate(unknown, inputs_embeds=None, attention_mask=pad) is pad
    assert mask_builders.create_masks_for_generate(unknown, inputs_embeds=None, attention_mask=None) is None


def test_masks_for_generate_without_layer_types_picks_one_builder():
    x = torch.zeros(1, 5, 8)
    sliding = mask_builders.create_masks_for_generate(_config("eager", sliding_window=2), x, None, None)
    assert torch.equal(sliding == 0, mask_builders.create_sliding_window_causal_mask(
        _config("eager", sliding_window=2), x, None) == 0)
    chunked = mask_builders.create_masks_for_generate(_config("sdpa", attention_chunk_size=2), x, None, None)
    assert torch.equal(chunked[0, 0], grid(["10000", "11000", "00100", "00110", "00001"]))
    assert mask_builders.create_masks_for_generate(_config("sdpa"), x, None, None) is None  # sdpa's is_causal
