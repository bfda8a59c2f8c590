"""The ``create_*_mask`` builders models call: a pattern plus sizes, handed to a formatter.

The builders follow transformers' ``masking_utils``: they read the implementation's name from
``config`` and hand the pattern (a mask function from :mod:`.mask_functions`) to the formatter
registered under that name in ``ALL_MASK_ATTENTION_FUNCTIONS``. A user-built 4D mask is returned
untouched.

Every public builder turns its keywords into one :class:`MaskOptions` record and calls
:func:`build_mask`; the builders differ only in the base pattern and in which skip they allow.
"""

from __future__ import annotations

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
]


@dataclass(frozen=True)
class MaskOptions:
    """What a builder needs besides config, inputs and the 2D mask (all optional).

    ``causal`` picks the family: causal builders may skip to sdpa's ``is_causal`` and detect
    packed sequences from ``position_ids``; bidirectional ones may skip a mask without padding and
    take their key length from ``encoder_hidden_states``. ``local_size`` is the window or chunk
    length (a formatter may skip the mask only when the keys fit in it).
    """

    causal: bool = True
    cache: Any = None
    position_ids: torch.Tensor | None = None
    encoder_hidden_states: torch.Tensor | None = None
    or_mask_function: MaskFunction | None = None
    and_mask_function: MaskFunction | None = None
    past_key_values_length: int = 0
    layer_idx: int = 0
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


def _mask_sizes(
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache: Any,
    past_key_values_length: int,
    layer_idx: int,
    encoder_hidden_states: torch.Tensor | None = None,
) -> tuple[int, int, int, int]:
    """(q_length, kv_length, q_offset, kv_offset) for this forward."""
    q_length = inputs_embeds.shape[1]
    if cache is not None and hasattr(cache, "get_mask_sizes"):
        try:
            kv_length, kv_offset = cache.get_mask_sizes(q_length, layer_idx)
        except TypeError:
            kv_length, kv_offset = cache.get_mask_sizes(q_length)
        if hasattr(cache, "get_query_offset"):
            q_offset = cache.get_query_offset(layer_idx)
        else:
            q_offset = cache.get_seq_length(layer_idx) if hasattr(cache, "get_seq_length") else 0
        return q_length, int(kv_length), q_offset, int(kv_offset)
    if cache is not None and hasattr(cache, "get_seq_length"):
        past_key_values_length = int(cache.get_seq_length())
    if encoder_hidden_states is not None:
        return q_length, encoder_hidden_states.shape[1], 0, 0
    if past_key_values_length:
        return q_length, past_key_values_length + q_length, past_key_values_length, 0
    if attention_mask is not None:
        # e.g. prefix tuning: the 2D mask is longer than the input
        return q_length, attention_mask.shape[-1], 0, 0
    return q_length, q_length, 0, 0


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
    **formatter_kwargs: Any,
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
    formatter = _formatter_for(_implementation_name(config))
    if formatter is None:
        return None
    if attention_mask is not None:
        attention_mask = attention_mask.to(device=inputs_embeds.device, dtype=torch.bool)
    cache, past = options.cache, options.past_key_values_length
    encoder = None if options.causal else options.encoder_hidden_states
    q_length, kv_length, q_offset, kv_offset = _mask_sizes(
        inputs_embeds, attention_mask, cache, past, options.layer_idx, encoder
    )
    batch_size = inputs_embeds.shape[0]
    mask_function, custom = _combine(base, options)
    allow_skip = options.allow_skip and not custom
    if options.causal:
        # Packed sequences (several sequences in one row, found from position_ids) only when there
        # is no padding mask and no cache: the training layout.
        position_ids = options.position_ids
        packed = None
        if position_ids is not None and attention_mask is None and cache is None and not past:
            position_ids = position_ids.expand(batch_size, -1)
            packed = find_packed_sequence_indices(position_ids)
        if packed is not None:
            mask_function = and_masks(
                remap_positions_for_packed_sequence(mask_function, position_ids), packed_sequence_mask_function(packed)
            )
            allow_skip = False
        skips = {"allow_is_causal_skip": allow_skip}
    else:
        skips = {"allow_is_causal_skip": False, "allow_is_bidirectional_skip": allow_skip}
    return formatter(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        local_size=options.local_size,
        dtype=inputs_embeds.dtype,
        device=inputs_embeds.device,
        config=config,
        **skips,
        **formatter_kwargs,
    )


def _config_int(config: Any, attr: str, builder: str) -> int:
    value = getattr(config, attr, None)
    if value is None:
        raise ValueError(f"{builder} needs config.{attr} to be set (got None)")
    return int(value)


def create_causal_mask(
    config: Any,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache: Any = None,
    position_ids: torch.Tensor | None = None,
    *,
    or_mask_function: MaskFunction | None = None,
    and_mask_function: MaskFunction | None = None,
    past_key_values_length: int = 0,
    layer_idx: int = 0,
    allow_is_causal_skip: bool = True,
) -> Any:
    """The causal mask in the format of the backend named by ``config._attn_implementation``.

    Args:
        config: any object with ``_attn_implementation`` (or ``attn_implementation``), or the name
            itself; ``config.is_causal = False`` gives a bidirectional mask instead.
        inputs_embeds: ``[batch, q_len, ...]``; gives batch size, query length, dtype, device.
        attention_mask: 2D ``[batch, kv_len]`` padding mask (1/True = real token), a prepared 4D
            mask or BlockMask (returned untouched), or None.
        cache: optional KV cache: transformers' ``Cache`` (``get_mask_sizes``) or anything with
            ``get_seq_length()``.
        position_ids: ``[batch or 1, q_len]``; restarts in positions mark packed sequences.
        or_mask_function / and_mask_function: extra predicates OR-ed / AND-ed with causality.
        past_key_values_length: tokens already cached, when no ``cache`` object is given.

    Returns:
        Whatever the formatter returns (4D bool / float, 2D, BlockMask) or None when the backend
        needs no mask (e.g. sdpa with ``is_causal``) or has no formatter (warned once).

    Raises:
        ValueError: a mask of an unsupported rank.
        UnsupportedAttentionOptionError: the backend's formatter cannot express the pattern.
    """
    options = MaskOptions(
        cache=cache, position_ids=position_ids, or_mask_function=or_mask_function,
        and_mask_function=and_mask_function, past_key_values_length=past_key_values_length, layer_idx=layer_idx,
        allow_skip=allow_is_causal_skip,
    )
    if not getattr(config, "is_causal", True):
        options = replace(options, causal=False, position_ids=None, layer_idx=0, allow_skip=True)
        return build_mask(bidirectional_mask_function, config, inputs_embeds, attention_mask, options)
    return build_mask(causal_mask_function, config, inputs_embeds, attention_mask, options)


def create_sliding_window_causal_mask(
    config: Any,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache: Any = None,
    position_ids: torch.Tensor | None = None,
    *,
    or_mask_function: MaskFunction | None = None,
    and_mask_function: MaskFunction | None = None,
    past_key_values_length: int = 0,
    layer_idx: int = 0,
    allow_is_causal_skip: bool = True,
) -> Any:
    """Causal mask limited to ``config.sliding_window`` keys (see :func:`create_causal_mask`).

    Raises:
        ValueError: ``config.sliding_window`` is not set.
    """
    if not getattr(config, "is_causal", True):
        return create_bidirectional_sliding_window_mask(
            config, inputs_embeds, attention_mask, cache=cache, or_mask_function=or_mask_function,
            and_mask_function=and_mask_function, past_key_values_length=past_key_values_length,
        )
    window = _config_int(config, "sliding_window", "create_sliding_window_causal_mask")
    options = MaskOptions(
        cache=cache, position_ids=position_ids, or_mask_function=or_mask_function,
        and_mask_function=and_mask_function, past_key_values_length=past_key_values_length, layer_idx=layer_idx,
        allow_skip=allow_is_causal_skip, local_size=window,
    )
    return build_mask(sliding_window_causal_mask_function(window), config, inputs_embeds, attention_mask, options)


def create_chunked_causal_mask(
    config: Any,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache: Any = None,
    position_ids: torch.Tensor | None = None,
    *,
    or_mask_function: MaskFunction | None = None,
    and_mask_function: MaskFunction | None = None,
    past_key_values_length: int = 0,
    layer_idx: int = 0,
    allow_is_causal_skip: bool = True,
) -> Any:
    """Causal attention within chunks of ``config.attention_chunk_size`` tokens.

    Chunks start at each row's first real token (left padding shifts them).

    Raises:
        ValueError: ``config.attention_chunk_size`` is not set.
        UnsupportedAttentionOptionError: a FlashAttention backend and a sequence longer than one
            chunk (the kernel has no chunked pattern).
    """
    chunk = _config_int(config, "attention_chunk_size", "create_chunked_causal_mask")
    left_padding = None
    if attention_mask is not None and torch.is_tensor(attention_mask) and attention_mask.dim() == 2:
        # tokens before the first real one
        left_padding = (attention_mask.to(torch.bool).cumsum(-1) == 0).sum(-1)
    options = MaskOptions(
        cache=cache, position_ids=position_ids, or_mask_function=or_mask_function,
        and_mask_function=and_mask_function, past_key_values_length=past_key_values_length, layer_idx=layer_idx,
        allow_skip=allow_is_causal_skip, local_size=chunk,
    )
    return build_mask(chunked_causal_mask_function(chunk, left_padding), config, inputs_embeds, attention_mask, options)


def create_bidirectional_mask(
    config: Any,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    encoder_hidden_states: torch.Tensor | None = None,
    cache: Any = None,
    *,
    or_mask_function: MaskFunction | None = None,
    and_mask_function: MaskFunction | None = None,
    past_key_values_length: int = 0,
    allow_is_bidirectional_skip: bool = True,
) -> Any:
    """Full (encoder) attention, masking only padded keys.

    ``encoder_hidden_states`` sets the key length for cross-attention. Returns None when nothing
    needs masking and the backend allows it (sdpa, eager: no padding, no custom predicate).

    Raises:
        ValueError: a mask of an unsupported rank.
    """
    options = MaskOptions(
        causal=False, cache=cache, encoder_hidden_states=encoder_hidden_states, or_mask_function=or_mask_function,
        and_mask_function=and_mask_function, past_key_values_length=past_key_values_length,
        allow_skip=allow_is_bidirectional_skip,
    )
    return build_mask(bidirectional_mask_function, config, inputs_embeds, attention_mask, options)


def create_bidirectional_sliding_window_mask(
    config: Any,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    encoder_hidden_states: torch.Tensor | None = None,
    cache: Any = None,
    *,
    or_mask_function: MaskFunction | None = None,
    and_mask_function: MaskFunction | None = None,
    past_key_values_length: int = 0,
    allow_is_bidirectional_skip: bool = True,
) -> Any:
    """Bidirectional attention limited to ``|q - kv| <= config.sliding_window``.

    Raises:
        ValueError: ``config.sliding_window`` is not set.
    """
    window = _config_int(config, "sliding_window", "create_bidirectional_sliding_window_mask")
    options = MaskOptions(
        causal=False, cache=cache, encoder_hidden_states=encoder_hidden_states, or_mask_function=or_mask_function,
        and_mask_function=and_mask_function, past_key_values_length=past_key_values_length,
        allow_skip=allow_is_bidirectional_skip, local_size=window,
    )
    return build_mask(sliding_window_bidirectional_mask_function(window), config, inputs_embeds, attention_mask, options)
