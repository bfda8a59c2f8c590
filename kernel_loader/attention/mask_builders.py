"""The ``create_*_mask`` builders models call: a pattern plus sizes, handed to a formatter.

The builders follow transformers' ``masking_utils``: they read the implementation's name from
``config`` and hand the pattern (a mask function from :mod:`.mask_functions`) to the formatter
registered under that name in ``ALL_MASK_ATTENTION_FUNCTIONS``. A user-built 4D mask is returned
untouched.

They take every keyword transformers' builders take in 4.57 and 5.17-5.25: ``cache`` or its
other name ``past_key_values``, ``inputs_embeds`` or 4.57's ``input_embeds``, 4.57's
``cache_position``, ``block_sequence_ids``, ``layer_idx`` (None: the first layer of the right
kind in a hybrid cache). Every public builder turns its keywords into one :class:`MaskOptions`
record and calls :func:`build_mask`; the builders differ only in the base pattern and in which
skip they allow.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from kernel_loader.attention.mask_functions import (
    MaskFunction,
    and_masks,
    bidirectional_mask_function,
    blockwise_overlay,
    causal_mask_function,
    chunked_causal_mask_function,
    find_packed_sequence_indices,
    or_masks,
    packed_sequence_mask_function,
    remap_positions_for_packed_sequence,
    sliding_window_bidirectional_mask_function,
    sliding_window_causal_mask_function,
)
from kernel_loader.attention.registry import ALL_MASK_ATTENTION_FUNCTIONS
from kernel_loader.errors import UnknownAttentionBackendError

logger = logging.getLogger(__name__)

__all__ = [
    "MaskOptions",
    "build_mask",
    "create_causal_mask",
    "create_bidirectional_mask",
    "create_sliding_window_causal_mask",
    "create_chunked_causal_mask",
    "create_bidirectional_sliding_window_mask",
    "create_recurrent_attention_mask",
    "create_masks_for_generate",
    "LAYER_TYPE_BUILDERS",
]


@dataclass(frozen=True)
class MaskOptions:
    """What a builder needs besides config, inputs and the 2D mask (all optional).

    ``causal`` picks the family: causal builders may skip to sdpa's ``is_causal`` and detect
    packed sequences from ``position_ids``; bidirectional ones may skip a mask without padding and
    take their key length from ``encoder_hidden_states``. ``local_size`` is the window or chunk
    length (a formatter may skip the mask only when the keys fit in it). ``cache_position`` (the
    absolute positions of the queries, transformers 4.57) sets the query offset; ``layer_idx`` None
    means the first layer of the builder's kind in a hybrid cache.
    """

    causal: bool = True
    cache: Any = None
    position_ids: torch.Tensor | None = None
    encoder_hidden_states: torch.Tensor | None = None
    or_mask_function: MaskFunction | None = None
    and_mask_function: MaskFunction | None = None
    block_sequence_ids: torch.Tensor | None = None
    cache_position: torch.Tensor | None = None
    past_key_values_length: int = 0
    layer_idx: int | None = None
    sliding_layers: bool = False
    allow_skip: bool = True
    local_size: int | None = None

_warned: set[str] = set()


def _warn_once(key: str, message: str, category: type[Warning] = UserWarning) -> None:
    if key in _warned:
        return
    _warned.add(key)
    logger.debug(message)
    warnings.warn(message, category, stacklevel=4)


def _implementation_name(config: Any) -> str | None:
    if isinstance(config, str):
        return config
    for attr in ("_attn_implementation", "attn_implementation"):
        name = getattr(config, attr, None)
        if isinstance(name, str):
            return name
    return None


def _is_float_one_zero_mask(mask: torch.Tensor) -> bool:
    if mask.dtype == torch.bool or not mask.is_floating_point() or mask.numel() == 0:
        return False
    if mask.device.type == "meta":
        return False
    values = torch.unique(mask)
    return bool(((values == 0) | (values == 1)).all()) and bool((values == 1).any())


def _check_user_4d_mask(mask: torch.Tensor) -> None:
    # The most common mask bug: a float 4D mask holding 1 (attend) / 0 (masked). Float masks are
    # *added* to the scores, so such a mask masks nothing; it is passed on untouched but flagged.
    if _is_float_one_zero_mask(mask):
        _warn_once(
            "float-one-zero",
            "A 4D float attention mask holding only 1.0 and 0.0 was given. Float masks are added to "
            "the attention scores (0 = attend, -inf/dtype-min = masked), so this mask hides nothing. "
            "Pass a bool mask (True = attend) or convert it: "
            "`(1.0 - mask) * torch.finfo(dtype).min`.",
        )


def _first_layer(cache: Any, sliding: bool) -> int:
    """transformers' default layer of a hybrid cache: the first sliding one, or the first full one."""
    is_sliding = list(getattr(cache, "is_sliding", None) or [])
    if sliding:
        return is_sliding.index(True) if True in is_sliding else 0
    linear = list(getattr(cache, "is_linear", None) or [False] * len(is_sliding))
    dummy = list(getattr(cache, "is_dummy", None) or [False] * len(is_sliding))
    full = [not (s or li or d) for s, li, d in zip(is_sliding, linear, dummy)]
    return full.index(True) if True in full else 0


def _is_paged_cache(cache: Any) -> bool:
    # continuous batching's cache: its attention functions mask from the cache itself
    return any(cls.__name__ == "PagedAttentionCache" for cls in type(cache).__mro__)


def _mask_sizes(
    inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None, options: MaskOptions, layer_idx: int
) -> tuple[int, int, int, int]:
    """(q_length, kv_length, q_offset, kv_offset) for this forward."""
    q_length = inputs_embeds.shape[1]
    cache, cache_position = options.cache, options.cache_position
    q_offset = int(cache_position[0]) if cache_position is not None and cache_position.numel() else 0
    if cache is not None and hasattr(cache, "get_mask_sizes"):
        if hasattr(cache, "get_query_offset"):  # transformers 5: sizes from the query length
            kv_length, kv_offset = cache.get_mask_sizes(q_length, layer_idx)
            q_offset = cache.get_query_offset(layer_idx)
        elif cache_position is not None:  # transformers 4.57: sizes from the query positions
            kv_length, kv_offset = cache.get_mask_sizes(cache_position, layer_idx)
        else:
            try:
                kv_length, kv_offset = cache.get_mask_sizes(q_length, layer_idx)
            except TypeError:
                kv_length, kv_offset = cache.get_mask_sizes(q_length)
            q_offset = cache.get_seq_length(layer_idx) if hasattr(cache, "get_seq_length") else 0
        return q_length, int(kv_length), q_offset, int(kv_offset)
    past = options.past_key_values_length
    if cache is not None and hasattr(cache, "get_seq_length"):
        past = int(cache.get_seq_length())
    encoder = None if options.causal else options.encoder_hidden_states
    if encoder is not None:
        return q_length, encoder.shape[1], 0, 0
    if past:
        return q_length, past + q_length, past, 0
    if attention_mask is not None:
        # e.g. prefix tuning: the 2D mask is longer than the input
        return q_length, attention_mask.shape[-1], q_offset, 0
    return q_length, q_length, q_offset, 0


def _formatter_for(name: str | None) -> Callable[..., Any] | None:
    if name is None:
        _warn_once(
            "no-name",
            "create_*_mask got a config without `_attn_implementation`; no mask is built. Set "
            "config._attn_implementation to the backend's name (e.g. 'sdpa').",
        )
        return None
    try:
        # A kernel id is loaded and its formatter registered by the registry's name resolver.
        return ALL_MASK_ATTENTION_FUNCTIONS.get_interface(name)
    except UnknownAttentionBackendError:
        pass
    # transformers returns None here without a word, which silently turns causal/padded attention
    # into full attention for custom backends; we keep the None (the function may not want a
    # mask) but say so once.
    _warn_once(
        f"no-formatter:{name}",
        f"Attention implementation {name!r} has no mask formatter, so its attention_mask is None "
        "(padding and causality are not applied unless the function does it itself). Register one: "
        f"`AttentionMaskInterface.register({name!r}, sdpa_mask)` (4D bool), `eager_mask` (4D float) "
        "or `flash_attention_mask` (2D padding).",
    )
    return None


def _combine(base: MaskFunction, options: MaskOptions) -> tuple[MaskFunction, bool]:
    custom = False
    if options.or_mask_function is not None:
        base = or_masks(base, options.or_mask_function)
        custom = True
    if options.and_mask_function is not None:
        base = and_masks(base, options.and_mask_function)
        custom = True
    return base, custom


def build_mask(
    base: MaskFunction,
    config: Any,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    options: MaskOptions,
) -> Any:
    """The mask for pattern ``base`` in the format of ``config``'s backend (the builders' core).

    Raises:
        ValueError: a mask of an unsupported rank.
        UnsupportedAttentionOptionError: the backend's formatter cannot express the pattern.
    """
    if attention_mask is not None and not torch.is_tensor(attention_mask):
        return attention_mask  # a BlockMask or another prepared object
    if attention_mask is not None and attention_mask.dim() == 4:
        _check_user_4d_mask(attention_mask)
        return attention_mask
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"attention_mask must be 2D [batch, kv_len] (1 = real token) or a prepared 4D mask; "
            f"got shape {tuple(attention_mask.shape)}"
        )
    cache = options.cache
    if cache is not None and _is_paged_cache(cache):
        return None
    formatter = _formatter_for(_implementation_name(config))
    if formatter is None:
        return None
    if attention_mask is not None:
        attention_mask = attention_mask.to(device=inputs_embeds.device, dtype=torch.bool)
    layer_idx = options.layer_idx if options.layer_idx is not None else _first_layer(cache, options.sliding_layers)
    q_length, kv_length, q_offset, kv_offset = _mask_sizes(inputs_embeds, attention_mask, options, layer_idx)
    embeds = options.encoder_hidden_states if not options.causal and options.encoder_hidden_states is not None \
        else inputs_embeds
    batch_size = embeds.shape[0]
    mask_function, custom = _combine(base, options)
    allow_skip = options.allow_skip and not custom
    # Packed sequences (several sequences in one row, found from position_ids) only when there is
    # no padding mask and no cache: the training layout (bidirectional builders too, from 5.25)
    position_ids = options.position_ids
    packed = None
    if position_ids is not None and attention_mask is None and cache is None and not options.past_key_values_length:
        position_ids = position_ids.expand(batch_size, -1)
        packed = find_packed_sequence_indices(position_ids)
    if packed is not None:
        mask_function = remap_positions_for_packed_sequence(mask_function, position_ids)
        allow_skip = False
    if options.causal:
        # a compiled decode step must see the same graph every step
        allow_skip = allow_skip and not (getattr(cache, "is_compileable", False) and q_length == 1)
        if options.block_sequence_ids is not None:
            blocks = options.block_sequence_ids.to(inputs_embeds.device)
            missing = kv_length + kv_offset - blocks.shape[-1]
            if missing > 0:  # keys past the ids (a static cache): in no block
                blocks = torch.nn.functional.pad(blocks, (0, missing), value=-1)
            mask_function = or_masks(mask_function, blockwise_overlay(blocks))
            allow_skip = False
        skips = {"allow_is_causal_skip": allow_skip}
    else:
        skips = {"allow_is_causal_skip": False, "allow_is_bidirectional_skip": allow_skip}
    if packed is not None:  # after the block overlay: a block never spans two packed sequences
        mask_function = and_masks(mask_function, packed_sequence_mask_function(packed))
    return formatter(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        local_size=options.local_size,
        dtype=embeds.dtype,
        device=inputs_embeds.device,
        config=config,
        **skips,
    )


def _config_int(config: Any, attr: str, builder: str) -> int:
    value = getattr(config, attr, None)
    if value is None:
        raise ValueError(f"{builder} needs config.{attr} to be set (got None)")
    return int(value)


def _inputs(
    builder: str, inputs_embeds: Any, input_embeds: Any, cache: Any, past_key_values: Any, required: bool = True
) -> tuple[Any, Any]:
    """``inputs_embeds`` and ``cache`` from either of their names (transformers 4.57 / 5.17 / 5.24 / 5.25).

    Raises:
        TypeError: neither name of the inputs was given, or both names of one argument with
            different values.
    """
    if input_embeds is not None:
        if inputs_embeds is not None and inputs_embeds is not input_embeds:
            raise TypeError(f"{builder}() got both inputs_embeds and input_embeds (the same argument); pass one")
        inputs_embeds = input_embeds
    if inputs_embeds is None and required:
        raise TypeError(f"{builder}() needs inputs_embeds (the [batch, q_len, ...] input, for sizes, dtype, device)")
    if past_key_values is not None:
        if cache is not None and cache is not past_key_values:
            raise TypeError(f"{builder}() got both cache and past_key_values (the same argument); pass one")
        cache = past_key_values
    return inputs_embeds, cache


def create_causal_mask(
    config: Any,
    inputs_embeds: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    cache: Any = None,
    position_ids: torch.Tensor | None = None,
    or_mask_function: MaskFunction | None = None,
    and_mask_function: MaskFunction | None = None,
    block_sequence_ids: torch.Tensor | None = None,
    layer_idx: int | None = None,
    allow_is_causal_skip: bool = True,
    *,
    past_key_values: Any = None,
    input_embeds: torch.Tensor | None = None,
    cache_position: torch.Tensor | None = None,
    past_key_values_length: int = 0,
) -> Any:
    """The causal mask in the format of the backend named by ``config._attn_implementation``.

    Args:
        config: any object with ``_attn_implementation`` (or ``attn_implementation``), or the name
            itself; ``config.is_causal = False`` gives a bidirectional mask instead.
        inputs_embeds: ``[batch, q_len, ...]``; gives batch size, query length, dtype, device
            (``input_embeds`` is the same argument, as transformers 4.57 names it).
        attention_mask: 2D ``[batch, kv_len]`` padding mask (1/True = real token), a prepared 4D
            mask or BlockMask (returned untouched), or None.
        cache: optional KV cache: transformers' ``Cache`` (``get_mask_sizes``) or anything with
            ``get_seq_length()``; ``past_key_values`` is the same argument. A continuous-batching
            ``PagedAttentionCache`` needs no mask (None).
        position_ids: ``[batch or 1, q_len]``; restarts in positions mark packed sequences.
        or_mask_function / and_mask_function: extra predicates OR-ed / AND-ed with causality.
        block_sequence_ids: ``[batch, len]`` block ids: tokens of one block (id >= 0) see each
            other both ways, everything else stays causal.
        layer_idx: the cache layer to size the mask by (None: the first full-attention layer).
        allow_is_causal_skip: whether sdpa may get None and use ``is_causal``.
        cache_position: the queries' absolute positions (transformers 4.57): the query offset.
        past_key_values_length: tokens already cached, when no ``cache`` object is given.

    Returns:
        Whatever the formatter returns (4D bool / float, 2D, BlockMask) or None when the backend
        needs no mask (e.g. sdpa with ``is_causal``) or has no formatter (warned once).

    Raises:
        TypeError: no ``inputs_embeds``, or both names of one argument with different values.
        ValueError: a mask of an unsupported rank.
        UnsupportedAttentionOptionError: the backend's formatter cannot express the pattern.
    """
    inputs_embeds, cache = _inputs("create_causal_mask", inputs_embeds, input_embeds, cache, past_key_values)
    options = MaskOptions(
        cache=cache, position_ids=position_ids, or_mask_function=or_mask_function,
        and_mask_function=and_mask_function, block_sequence_ids=block_sequence_ids, cache_position=cache_position,
        past_key_values_length=past_key_values_length, layer_idx=layer_idx, allow_skip=allow_is_causal_skip,
    )
    if not getattr(config, "is_causal", True):
        options = replace(options, causal=False, position_ids=None, block_sequence_ids=None, layer_idx=None)
        return build_mask(bidirectional_mask_function, config, inputs_embeds, attention_mask, options)
    return build_mask(causal_mask_function, config, inputs_embeds, attention_mask, options)


def create_sliding_window_causal_mask(
    config: Any,
    inputs_embeds: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    cache: Any = None,
    position_ids: torch.Tensor | None = None,
    or_mask_function: MaskFunction | None = None,
    and_mask_function: MaskFunction | None = None,
    block_sequence_ids: torch.Tensor | None = None,
    layer_idx: int | None = None,
    allow_is_causal_skip: bool = True,
    *,
    past_key_values: Any = None,
    input_embeds: torch.Tensor | None = None,
    cache_position: torch.Tensor | None = None,
    past_key_values_length: int = 0,
) -> Any:
    """Causal mask limited to ``config.sliding_window`` keys (arguments: :func:`create_causal_mask`;
    ``layer_idx`` None means the first sliding layer of a hybrid cache).

    Raises:
        ValueError: ``config.sliding_window`` is not set.
    """
    inputs_embeds, cache = _inputs("create_sliding_window_causal_mask", inputs_embeds, input_embeds, cache,
                                   past_key_values)
    if not getattr(config, "is_causal", True):
        return create_bidirectional_sliding_window_mask(
            config, inputs_embeds, attention_mask, cache=cache, or_mask_function=or_mask_function,
            and_mask_function=and_mask_function, allow_is_bidirectional_skip=allow_is_causal_skip,
            past_key_values_length=past_key_values_length,
        )
    window = _config_int(config, "sliding_window", "create_sliding_window_causal_mask")
    options = MaskOptions(
        cache=cache, position_ids=position_ids, or_mask_function=or_mask_function,
        and_mask_function=and_mask_function, block_sequence_ids=block_sequence_ids, cache_position=cache_position,
        past_key_values_length=past_key_values_length, layer_idx=layer_idx, sliding_layers=True,
        allow_skip=allow_is_causal_skip, local_size=window,
    )
    return build_mask(sliding_window_causal_mask_function(window), config, inputs_embeds, attention_mask, options)


def create_chunked_causal_mask(
    config: Any,
    inputs_embeds: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    cache: Any = None,
    position_ids: torch.Tensor | None = None,
    or_mask_function: MaskFunction | None = None,
    and_mask_function: MaskFunction | None = None,
    block_sequence_ids: torch.Tensor | None = None,
    layer_idx: int | None = None,
    allow_is_causal_skip: bool = True,
    *,
    past_key_values: Any = None,
    input_embeds: torch.Tensor | None = None,
    cache_position: torch.Tensor | None = None,
    past_key_values_length: int = 0,
) -> Any:
    """Causal attention within chunks of ``config.attention_chunk_size`` tokens (arguments:
    :func:`create_causal_mask`; ``layer_idx`` None means the first chunked layer of a hybrid cache).

    Chunks start at each row's first real token (left padding shifts them).

    Raises:
        ValueError: ``config.attention_chunk_size`` is not set.
        UnsupportedAttentionOptionError: a FlashAttention backend and a sequence longer than one
            chunk (the kernel has no chunked pattern).
    """
    inputs_embeds, cache = _inputs("create_chunked_causal_mask", inputs_embeds, input_embeds, cache, past_key_values)
    chunk = _config_int(config, "attention_chunk_size", "create_chunked_causal_mask")
    left_padding = None
    if attention_mask is not None and torch.is_tensor(attention_mask) and attention_mask.dim() == 2:
        # tokens before the first real one
        left_padding = (attention_mask.to(torch.bool).cumsum(-1) == 0).sum(-1)
    options = MaskOptions(
        cache=cache, position_ids=position_ids, or_mask_function=or_mask_function,
        and_mask_function=and_mask_function, block_sequence_ids=block_sequence_ids, cache_position=cache_position,
        past_key_values_length=past_key_values_length, layer_idx=layer_idx, sliding_layers=True,
        allow_skip=allow_is_causal_skip, local_size=chunk,
    )
    return build_mask(chunked_causal_mask_function(chunk, left_padding), config, inputs_embeds, attention_mask, options)


def create_bidirectional_mask(
    config: Any,
    inputs_embeds: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    encoder_hidden_states: torch.Tensor | None = None,
    cache: Any = None,
    or_mask_function: MaskFunction | None = None,
    and_mask_function: MaskFunction | None = None,
    allow_is_bidirectional_skip: bool = True,
    position_ids: torch.Tensor | None = None,
    *,
    past_key_values: Any = None,
    input_embeds: torch.Tensor | None = None,
    past_key_values_length: int = 0,
    **kwargs: Any,
) -> Any:
    """Full (encoder) attention, masking only padded keys.

    ``encoder_hidden_states`` sets the batch size, key length and dtype for cross-attention.
    ``position_ids`` whose positions restart mark packed sequences (without a padding mask and a
    cache), each attending only to itself, as in transformers 5.25. Returns None when nothing
    needs masking and the backend allows it (sdpa, eager: no padding, no custom predicate).
    Other keywords are accepted and ignored, as transformers does.

    Raises:
        TypeError: no ``inputs_embeds``, or both names of one argument with different values.
        ValueError: a mask of an unsupported rank.
    """
    inputs_embeds, cache = _inputs("create_bidirectional_mask", inputs_embeds, input_embeds, cache, past_key_values)
    options = MaskOptions(
        causal=False, cache=cache, encoder_hidden_states=encoder_hidden_states, or_mask_function=or_mask_function,
        and_mask_function=and_mask_function, past_key_values_length=past_key_values_length,
        allow_skip=allow_is_bidirectional_skip, position_ids=position_ids,
    )
    return build_mask(bidirectional_mask_function, config, inputs_embeds, attention_mask, options)


def create_bidirectional_sliding_window_mask(
    config: Any,
    inputs_embeds: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    encoder_hidden_states: torch.Tensor | None = None,
    cache: Any = None,
    or_mask_function: MaskFunction | None = None,
    and_mask_function: MaskFunction | None = None,
    allow_is_bidirectional_skip: bool = True,
    position_ids: torch.Tensor | None = None,
    *,
    past_key_values: Any = None,
    input_embeds: torch.Tensor | None = None,
    past_key_values_length: int = 0,
    **kwargs: Any,
) -> Any:
    """Bidirectional attention limited to ``|q - kv| <= config.sliding_window`` (arguments:
    :func:`create_bidirectional_mask`).

    Raises:
        ValueError: ``config.sliding_window`` is not set.
    """
    inputs_embeds, cache = _inputs("create_bidirectional_sliding_window_mask", inputs_embeds, input_embeds, cache,
                                   past_key_values)
    window = _config_int(config, "sliding_window", "create_bidirectional_sliding_window_mask")
    options = MaskOptions(
        causal=False, cache=cache, encoder_hidden_states=encoder_hidden_states, or_mask_function=or_mask_function,
        and_mask_function=and_mask_function, past_key_values_length=past_key_values_length, sliding_layers=True,
        allow_skip=allow_is_bidirectional_skip, local_size=window, position_ids=position_ids,
    )
    return build_mask(sliding_window_bidirectional_mask_function(window), config, inputs_embeds, attention_mask, options)


def create_recurrent_attention_mask(
    config: Any,
    inputs_embeds: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    cache: Any = None,
    *,
    past_key_values: Any = None,
    input_embeds: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The 2D padding mask of a recurrent (mamba / linear-attention / conv) layer, or None.

    None when there is nothing to mask: no 2D mask (or a prepared 4D one), a single-token decode
    step (a generated token is never padding), or a mask of all ones. Otherwise the mask's last
    ``q_len`` columns, so that the layer can multiply its input by it directly.

    Raises:
        TypeError: no ``inputs_embeds``.
    """
    inputs_embeds, _ = _inputs("create_recurrent_attention_mask", inputs_embeds, input_embeds, cache, past_key_values)
    if attention_mask is None or not torch.is_tensor(attention_mask) or attention_mask.dim() != 2:
        return None
    q_length = inputs_embeds.shape[1]
    if q_length == 1:
        return None
    if not torch.compiler.is_compiling() and bool((attention_mask == 1).all()):
        return None
    return attention_mask[:, -q_length:].contiguous()


#: Which builder makes the mask of each ``config.layer_types`` entry (transformers' mapping); a
#: dict value means that layer type needs several masks.
LAYER_TYPE_BUILDERS: dict[str, Any] = {
    "full_attention": create_causal_mask,
    "sliding_attention": create_sliding_window_causal_mask,
    "chunked_attention": create_chunked_causal_mask,
    "compressed_sparse_attention": create_sliding_window_causal_mask,
    "heavily_compressed_attention": create_sliding_window_causal_mask,
    "minimax_m3_sparse": create_causal_mask,
    # indexers must see causality in the mask itself: no is_causal shortcut
    "indexed_attention": functools.partial(create_causal_mask, allow_is_causal_skip=False),
    "linear_attention": create_recurrent_attention_mask,
    "conv": create_recurrent_attention_mask,
    "hybrid": {"full_attention": create_causal_mask, "linear_attention": create_recurrent_attention_mask},
    "hybrid_sliding": {"sliding_attention": create_causal_mask, "linear_attention": create_recurrent_attention_mask},
}


def create_masks_for_generate(
    config: Any,
    inputs_embeds: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    cache: Any = None,
    position_ids: torch.Tensor | None = None,
    or_mask_function: MaskFunction | None = None,
    and_mask_function: MaskFunction | None = None,
    block_sequence_ids: torch.Tensor | None = None,
    *,
    past_key_values: Any = None,
    input_embeds: torch.Tensor | None = None,
    cache_position: torch.Tensor | None = None,
    **kwargs: Any,
) -> Any:
    """The masks a model's layers will ask for, built ahead (as ``generate`` does for compiled runs).

    Reads the text config (``config.get_text_config()`` when there is one). With
    ``config.layer_types``: a dict ``{layer type: mask}`` built by :data:`LAYER_TYPE_BUILDERS`, or
    ``attention_mask`` itself when a layer type has no builder (the model then makes its own).
    Otherwise one mask: sliding-window when ``config.sliding_window`` is set, chunked when
    ``config.attention_chunk_size`` is, else causal.

    Raises:
        TypeError: no ``inputs_embeds`` when a mask is to be built, or both names of one argument
            with different values.
        ValueError, UnsupportedAttentionOptionError: as the builders.
    """
    # inputs_embeds may be None when the layer types defer to the model (as in transformers)
    inputs_embeds, cache = _inputs("create_masks_for_generate", inputs_embeds, input_embeds, cache, past_key_values,
                                   required=False)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    causal_kwargs = {"cache_position": cache_position} if cache_position is not None else {}
    args: dict[str, Any] = {
        "config": text_config, "inputs_embeds": inputs_embeds, "attention_mask": attention_mask, "cache": cache,
        "position_ids": position_ids, "or_mask_function": or_mask_function, "and_mask_function": and_mask_function,
        "block_sequence_ids": block_sequence_ids,
    }

    def build(builder: Any) -> Any:
        if builder is create_recurrent_attention_mask:
            return builder(text_config, inputs_embeds, attention_mask, cache)
        return builder(**args, **causal_kwargs)

    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is not None:
        if any(kind not in LAYER_TYPE_BUILDERS for kind in layer_types):
            return attention_mask
        masks: dict[str, Any] = {}
        for kind in dict.fromkeys(layer_types):
            builder = LAYER_TYPE_BUILDERS[kind]
            for name, each in (builder.items() if isinstance(builder, dict) else ((kind, builder),)):
                if name not in masks:
                    masks[name] = build(each)
        return masks
    if getattr(text_config, "sliding_window", None) is not None:
        return build(create_sliding_window_causal_mask)
    if getattr(text_config, "attention_chunk_size", None) is not None:
        return build(create_chunked_causal_mask)
    return build(create_causal_mask)
