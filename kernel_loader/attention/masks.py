"""Attention masks built from small predicates, and the ``create_*`` builders models call.

A mask function answers "may query ``q_idx`` of batch row ``batch_idx`` attend to key
``kv_idx``?": ``fn(batch_idx, head_idx, q_idx, kv_idx) -> bool``. Called with broadcastable index
tensors it returns a broadcast bool tensor, which is how the 4D masks are materialised; FlexAttention
calls the same functions to build a ``BlockMask``.

Every function made here carries a ``mask_kind`` attribute (``"causal"``, ``"sliding_window"``,
``"and"`` with its ``parts``...). Formatters that cannot express an arbitrary pattern (the
FlashAttention 2D padding mask) read it to refuse a pattern they would otherwise drop.

The builders follow transformers' ``masking_utils``: they read the implementation's name from
``config`` and hand the pattern to the formatter registered under that name in
``ALL_MASK_ATTENTION_FUNCTIONS``. A user-built 4D mask is returned untouched.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch

from kernel_loader.attention.registry import ALL_MASK_ATTENTION_FUNCTIONS

logger = logging.getLogger(__name__)

MaskFunction = Callable[[Any, Any, Any, Any], Any]

__all__ = [
    "MaskFunction",
    "and_masks",
    "or_masks",
    "causal_mask_function",
    "bidirectional_mask_function",
    "sliding_window_overlay",
    "sliding_window_causal_mask_function",
    "sliding_window_bidirectional_overlay",
    "sliding_window_bidirectional_mask_function",
    "chunked_overlay",
    "chunked_causal_mask_function",
    "padding_mask_function",
    "packed_sequence_mask_function",
    "remap_positions_for_packed_sequence",
    "add_offsets_to_mask_function",
    "find_packed_sequence_indices",
    "mask_kinds",
    "create_causal_mask",
    "create_bidirectional_mask",
    "create_sliding_window_causal_mask",
    "create_chunked_causal_mask",
    "create_bidirectional_sliding_window_mask",
]


def _tag(fn: MaskFunction, kind: str, **params: Any) -> MaskFunction:
    fn.mask_kind = kind  # type: ignore[attr-defined]
    fn.mask_params = params  # type: ignore[attr-defined]
    return fn


def mask_kinds(mask_function: MaskFunction) -> set[str]:
    """The set of primitive kinds a mask function is made of (``"custom"`` for untagged ones)."""
    kind = getattr(mask_function, "mask_kind", "custom")
    if kind in ("and", "or", "offset", "remap"):
        kinds = {kind} if kind == "or" else set()
        for part in mask_function.mask_params["parts"]:  # type: ignore[attr-defined]
            kinds |= mask_kinds(part)
        return kinds
    return {kind}


def _check_callables(name: str, fns: tuple[Any, ...]) -> None:
    if not fns:
        raise TypeError(f"{name}() needs at least one mask function")
    bad = [f for f in fns if not callable(f)]
    if bad:
        raise TypeError(f"{name}() takes mask functions (batch_idx, head_idx, q_idx, kv_idx) -> bool; got {bad!r}")


def and_masks(*mask_functions: MaskFunction) -> MaskFunction:
    """A mask function that allows a pair only when every given function allows it.

    Raises:
        TypeError: no function was given, or one is not callable.
    """
    _check_callables("and_masks", mask_functions)

    def and_mask(batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
        result = q_idx.new_ones((), dtype=torch.bool)
        for fn in mask_functions:
            result = result & torch.as_tensor(fn(batch_idx, head_idx, q_idx, kv_idx)).to(result.device)
        return result

    return _tag(and_mask, "and", parts=mask_functions)


def or_masks(*mask_functions: MaskFunction) -> MaskFunction:
    """A mask function that allows a pair when any given function allows it.

    Raises:
        TypeError: no function was given, or one is not callable.
    """
    _check_callables("or_masks", mask_functions)

    def or_mask(batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
        result = q_idx.new_zeros((), dtype=torch.bool)
        for fn in mask_functions:
            result = result | torch.as_tensor(fn(batch_idx, head_idx, q_idx, kv_idx)).to(result.device)
        return result

    return _tag(or_mask, "or", parts=mask_functions)


def causal_mask_function(batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
    """A query attends to itself and every earlier position."""
    return kv_idx <= q_idx


def bidirectional_mask_function(batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
    """Every query attends to every key (index-based so it broadcasts like the others)."""
    return (q_idx >= 0) | (kv_idx >= 0)


_tag(causal_mask_function, "causal")
_tag(bidirectional_mask_function, "bidirectional")


def sliding_window_overlay(sliding_window: int) -> MaskFunction:
    """Keys less than ``sliding_window`` positions behind the query (``q - kv < sliding_window``).

    Combine with :func:`causal_mask_function`; a query then sees ``sliding_window`` keys, itself
    included (FlashAttention's ``window_size=(sliding_window - 1, 0)``).
    """
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")

    def inner(batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
        return kv_idx > q_idx - sliding_window

    return _tag(inner, "sliding_window", window=sliding_window)


def sliding_window_causal_mask_function(sliding_window: int) -> MaskFunction:
    """Causal attention limited to the last ``sliding_window`` positions (Mistral-style)."""
    return and_masks(sliding_window_overlay(sliding_window), causal_mask_function)


def sliding_window_bidirectional_overlay(sliding_window: int) -> MaskFunction:
    """Keys within ``sliding_window`` positions either side (``|q - kv| <= sliding_window``)."""
    if sliding_window < 0:
        raise ValueError(f"sliding_window must be >= 0, got {sliding_window}")

    def inner(batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx - kv_idx).abs() <= sliding_window if torch.is_tensor(q_idx) else abs(q_idx - kv_idx) <= sliding_window

    return _tag(inner, "sliding_window_bidirectional", window=sliding_window)


def sliding_window_bidirectional_mask_function(sliding_window: int) -> MaskFunction:
    """Bidirectional attention limited to ``|q - kv| <= sliding_window``."""
    return and_masks(sliding_window_bidirectional_overlay(sliding_window), bidirectional_mask_function)


def chunked_overlay(chunk_size: int, left_padding: torch.Tensor | None = None) -> MaskFunction:
    """Query and key lie in the same chunk of ``chunk_size`` tokens (Llama-4 style).

    Chunks are counted from each row's first real token, so ``left_padding`` (tokens of left
    padding per batch row) shifts them.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")

    def inner(batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
        shift = 0 if left_padding is None else left_padding[batch_idx]
        return (kv_idx - shift) // chunk_size == (q_idx - shift) // chunk_size

    return _tag(inner, "chunked", chunk_size=chunk_size)


def chunked_causal_mask_function(chunk_size: int, left_padding: torch.Tensor | None = None) -> MaskFunction:
    """Causal attention within chunks of ``chunk_size`` tokens."""
    return and_masks(chunked_overlay(chunk_size, left_padding), causal_mask_function)


def padding_mask_function(padding_mask: torch.Tensor) -> MaskFunction:
    """Keys whose entry in the 2D ``padding_mask`` (``[batch, kv_len]``, True = real token) is set.

    The mask must cover every ``kv_idx`` asked for; pad it first (:func:`_pad_padding_mask`).
    """
    padding_mask = padding_mask.to(torch.bool)

    def inner(batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
        return padding_mask[batch_idx, kv_idx]

    return _tag(inner, "padding", padding_mask=padding_mask)


def packed_sequence_mask_function(packed_sequence_mask: torch.Tensor) -> MaskFunction:
    """Query and key belong to the same packed sequence (``[batch, len]`` sequence ids)."""

    def inner(batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
        return packed_sequence_mask[batch_idx, q_idx] == packed_sequence_mask[batch_idx, kv_idx]

    return _tag(inner, "packed_sequence", packed_sequence_mask=packed_sequence_mask)


def remap_positions_for_packed_sequence(mask_function: MaskFunction, position_ids: torch.Tensor) -> MaskFunction:
    """Evaluate ``mask_function`` on per-sequence positions instead of flat indices.

    A sliding window or chunk then restarts with every packed sequence.
    """

    def inner(batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
        return mask_function(batch_idx, head_idx, position_ids[batch_idx, q_idx], position_ids[batch_idx, kv_idx])

    return _tag(inner, "remap", parts=(mask_function,))


def add_offsets_to_mask_function(mask_function: MaskFunction, q_offset: int, kv_offset: int) -> MaskFunction:
    """Shift indices by the offsets (FlexAttention only passes 0-based indices)."""

    def inner(batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
        return mask_function(batch_idx, head_idx, q_idx + q_offset, kv_idx + kv_offset)

    return _tag(inner, "offset", parts=(mask_function,))


def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Sequence ids ``[batch, len]`` of packed sequences, or None when each row holds one sequence.

    A new sequence starts wherever the position does not follow the previous one by exactly 1;
    e.g. positions ``[[0, 1, 0, 1, 2, 0]]`` give ``[[0, 0, 1, 1, 1, 2]]``.
    """
    first = position_ids[:, :1] - 1
    starts = torch.diff(position_ids, prepend=first, dim=-1) != 1
    seq_ids = starts.cumsum(-1)
    if bool((seq_ids[:, -1] == 0).all()):
        return None
    return seq_ids


# --------------------------------------------------------------------------------------------
# Builders
# --------------------------------------------------------------------------------------------

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
    if name in ALL_MASK_ATTENTION_FUNCTIONS:
        return ALL_MASK_ATTENTION_FUNCTIONS[name]
    from kernel_loader.refs import looks_like_kernel_ref

    if looks_like_kernel_ref(name):
        # Loads the kernel and registers its formatter under this exact name.
        return ALL_MASK_ATTENTION_FUNCTIONS.get_interface(name)
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


def _prepare(
    config: Any,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
) -> tuple[bool, Any, Callable[..., Any] | None]:
    """Early exits shared by all builders: user 4D masks, BlockMasks, backends without formatter."""
    if attention_mask is not None and not torch.is_tensor(attention_mask):
        return True, attention_mask, None  # a BlockMask or another prepared object
    if attention_mask is not None and attention_mask.dim() == 4:
        _check_user_4d_mask(attention_mask)
        return True, attention_mask, None
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"attention_mask must be 2D [batch, kv_len] (1 = real token) or a prepared 4D mask; "
            f"got shape {tuple(attention_mask.shape)}"
        )
    formatter = _formatter_for(_implementation_name(config))
    if formatter is None:
        return True, None, None
    if attention_mask is not None:
        attention_mask = attention_mask.to(device=inputs_embeds.device, dtype=torch.bool)
    return False, attention_mask, formatter


def _combine(
    base: MaskFunction, or_mask_function: MaskFunction | None, and_mask_function: MaskFunction | None
) -> tuple[MaskFunction, bool]:
    custom = False
    if or_mask_function is not None:
        base = or_masks(base, or_mask_function)
        custom = True
    if and_mask_function is not None:
        base = and_masks(base, and_mask_function)
        custom = True
    return base, custom


def _causal_family(
    base: MaskFunction,
    config: Any,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache: Any,
    position_ids: torch.Tensor | None,
    or_mask_function: MaskFunction | None,
    and_mask_function: MaskFunction | None,
    past_key_values_length: int,
    layer_idx: int,
    allow_is_causal_skip: bool,
    local_size: int | None,
    extra: dict[str, Any] | None = None,
) -> Any:
    early, attention_mask, formatter = _prepare(config, inputs_embeds, attention_mask)
    if early:
        return attention_mask
    q_length, kv_length, q_offset, kv_offset = _mask_sizes(
        inputs_embeds, attention_mask, cache, past_key_values_length, layer_idx
    )
    batch_size = inputs_embeds.shape[0]
    mask_function, custom = _combine(base, or_mask_function, and_mask_function)
    allow_is_causal_skip = allow_is_causal_skip and not custom

    # Packed sequences (several sequences in one row, found from position_ids) only when there is
    # no padding mask and no cache: the training layout.
    packed = None
    if position_ids is not None and attention_mask is None and cache is None and not past_key_values_length:
        position_ids = position_ids.expand(batch_size, -1)
        packed = find_packed_sequence_indices(position_ids)
    if packed is not None:
        mask_function = and_masks(
            remap_positions_for_packed_sequence(mask_function, position_ids), packed_sequence_mask_function(packed)
        )
        allow_is_causal_skip = False

    return formatter(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        allow_is_causal_skip=allow_is_causal_skip,
        local_size=local_size,
        dtype=inputs_embeds.dtype,
        device=inputs_embeds.device,
        config=config,
        **(extra or {}),
    )


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
    if not getattr(config, "is_causal", True):
        return create_bidirectional_mask(
            config,
            inputs_embeds,
            attention_mask,
            cache=cache,
            or_mask_function=or_mask_function,
            and_mask_function=and_mask_function,
            past_key_values_length=past_key_values_length,
        )
    return _causal_family(
        causal_mask_function,
        config,
        inputs_embeds,
        attention_mask,
        cache,
        position_ids,
        or_mask_function,
        and_mask_function,
        past_key_values_length,
        layer_idx,
        allow_is_causal_skip,
        local_size=None,
    )


def _config_int(config: Any, attr: str, builder: str) -> int:
    value = getattr(config, attr, None)
    if value is None:
        raise ValueError(f"{builder} needs config.{attr} to be set (got None)")
    return int(value)


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
            config,
            inputs_embeds,
            attention_mask,
            cache=cache,
            or_mask_function=or_mask_function,
            and_mask_function=and_mask_function,
            past_key_values_length=past_key_values_length,
        )
    window = _config_int(config, "sliding_window", "create_sliding_window_causal_mask")
    return _causal_family(
        sliding_window_causal_mask_function(window),
        config,
        inputs_embeds,
        attention_mask,
        cache,
        position_ids,
        or_mask_function,
        and_mask_function,
        past_key_values_length,
        layer_idx,
        allow_is_causal_skip,
        local_size=window,
    )


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
        am = attention_mask.to(torch.bool)
        # tokens before the first real one
        left_padding = (am.cumsum(-1) == 0).sum(-1)
    return _causal_family(
        chunked_causal_mask_function(chunk, left_padding),
        config,
        inputs_embeds,
        attention_mask,
        cache,
        position_ids,
        or_mask_function,
        and_mask_function,
        past_key_values_length,
        layer_idx,
        allow_is_causal_skip,
        local_size=chunk,
    )


def _bidirectional_family(
    base: MaskFunction,
    config: Any,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    encoder_hidden_states: torch.Tensor | None,
    cache: Any,
    or_mask_function: MaskFunction | None,
    and_mask_function: MaskFunction | None,
    past_key_values_length: int,
    allow_is_bidirectional_skip: bool,
    local_size: int | None,
) -> Any:
    early, attention_mask, formatter = _prepare(config, inputs_embeds, attention_mask)
    if early:
        return attention_mask
    q_length, kv_length, q_offset, kv_offset = _mask_sizes(
        inputs_embeds, attention_mask, cache, past_key_values_length, 0, encoder_hidden_states
    )
    mask_function, custom = _combine(base, or_mask_function, and_mask_function)
    return formatter(
        batch_size=inputs_embeds.shape[0],
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        allow_is_causal_skip=False,
        allow_is_bidirectional_skip=allow_is_bidirectional_skip and not custom,
        local_size=local_size,
        dtype=inputs_embeds.dtype,
        device=inputs_embeds.device,
        config=config,
    )


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
    return _bidirectional_family(
        bidirectional_mask_function,
        config,
        inputs_embeds,
        attention_mask,
        encoder_hidden_states,
        cache,
        or_mask_function,
        and_mask_function,
        past_key_values_length,
        allow_is_bidirectional_skip,
        local_size=None,
    )


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
    return _bidirectional_family(
        sliding_window_bidirectional_mask_function(window),
        config,
        inputs_embeds,
        attention_mask,
        encoder_hidden_states,
        cache,
        or_mask_function,
        and_mask_function,
        past_key_values_length,
        allow_is_bidirectional_skip,
        local_size=window,
    )
