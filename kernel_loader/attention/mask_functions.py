"""Mask predicates: the leaf of the attention layers (it imports nothing of kernel_loader).

A mask function answers "may query ``q_idx`` of batch row ``batch_idx`` attend to key
``kv_idx``?": ``fn(batch_idx, head_idx, q_idx, kv_idx) -> bool``. Called with broadcastable index
tensors it returns a broadcast bool tensor, which is how the 4D masks are materialised; FlexAttention
calls the same functions to build a ``BlockMask``.

Every function made here carries a ``mask_kind`` attribute (``"causal"``, ``"sliding_window"``,
``"and"`` with its ``parts``...). Formatters that cannot express an arbitrary pattern (the
FlashAttention 2D padding mask) read it to know what the pattern is without evaluating it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch

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
    "blockwise_overlay",
    "padding_mask_function",
    "packed_sequence_mask_function",
    "remap_positions_for_packed_sequence",
    "add_offsets_to_mask_function",
    "find_packed_sequence_indices",
    "mask_kinds",
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


def _combine(kind: str, mask_functions: tuple[MaskFunction, ...]) -> MaskFunction:
    # and_masks and or_masks differ only in the start value and the operator
    if not mask_functions:
        raise TypeError(f"{kind}_masks() needs at least one mask function")
    bad = [f for f in mask_functions if not callable(f)]
    if bad:
        raise TypeError(f"{kind}_masks() takes mask functions (batch_idx, head_idx, q_idx, kv_idx) -> bool; got {bad!r}")
    conjunction = kind == "and"
    op = operator.and_ if conjunction else operator.or_

    def combined(batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
        result = q_idx.new_ones((), dtype=torch.bool) if conjunction else q_idx.new_zeros((), dtype=torch.bool)
        for fn in mask_functions:
            result = op(result, torch.as_tensor(fn(batch_idx, head_idx, q_idx, kv_idx)).to(result.device))
        return result

    combined.__name__ = combined.__qualname__ = f"{kind}_mask"
    return _tag(combined, kind, parts=mask_functions)


def and_masks(*mask_functions: MaskFunction) -> MaskFunction:
    """A mask function that allows a pair only when every given function allows it.

    Raises:
        TypeError: no function was given, or one is not callable.
    """
    return _combine("and", mask_functions)


def or_masks(*mask_functions: MaskFunction) -> MaskFunction:
    """A mask function that allows a pair when any given function allows it.

    Raises:
        TypeError: no function was given, or one is not callable.
    """
    return _combine("or", mask_functions)


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


def blockwise_overlay(block_sequence_ids: torch.Tensor) -> MaskFunction:
    """Query and key lie in the same block (``[batch, len]`` block ids; ``-1`` = no block).

    OR-ed with a causal mask it lets the tokens of one block (an image, say) see each other both
    ways while everything else stays causal.
    """

    def inner(batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
        q_block = block_sequence_ids[batch_idx, q_idx]
        return (q_block == block_sequence_ids[batch_idx, kv_idx]) & (q_block >= 0)

    return _tag(inner, "blockwise", block_sequence_ids=block_sequence_ids)


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

    return _tag(inner, "remap", parts=(mask_function,), position_ids=position_ids)


def add_offsets_to_mask_function(mask_function: MaskFunction, q_offset: int, kv_offset: int) -> MaskFunction:
    """Shift indices by the offsets (FlexAttention only passes 0-based indices)."""

    def inner(batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
        return mask_function(batch_idx, head_idx, q_idx + q_offset, kv_idx + kv_offset)

    return _tag(inner, "offset", parts=(mask_function,), q_offset=q_offset, kv_offset=kv_offset)


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
