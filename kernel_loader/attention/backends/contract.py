"""What every backend shares: the parts of transformers' attention-function contract.

GQA grouping (``kv_groups``, ``repeat_kv``), which causality a call means (``resolve_is_causal``)
and the pattern a backend applies when it is given no mask (``implicit_mask``), so that eager,
sdpa, flex and FlashAttention agree on every call.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["repeat_kv", "kv_groups", "resolve_is_causal", "implicit_mask"]


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[B, Hkv, S, D]`` -> ``[B, Hkv * n_rep, S, D]``, each KV head repeated for its query group."""
    if n_rep == 1:
        return hidden_states
    b, h, s, d = hidden_states.shape
    return hidden_states[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def kv_groups(query: torch.Tensor, key: torch.Tensor) -> int:
    """Query heads per KV head (GQA/MQA), from the shapes.

    Raises:
        ValueError: the query head count is not a multiple of the KV head count.
    """
    hq, hkv = query.shape[1], key.shape[1]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query has {hq} heads, key/value {hkv}: the query heads must be a multiple of the KV heads")
    return hq // hkv


def resolve_is_causal(module: Any, is_causal: bool | None) -> bool:
    """The explicit ``is_causal`` if given, else ``module.is_causal``, else True (decoders)."""
    if is_causal is not None:
        return bool(is_causal)
    return bool(getattr(module, "is_causal", True))


def implicit_mask(
    q_length: int,
    kv_length: int,
    is_causal: bool,
    sliding_window: int | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor | None:
    """The bool ``[1, 1, q, kv]`` pattern a backend applies when it gets ``attention_mask=None``.

    Matches sdpa's conventions so that every backend agrees: a single query token is the last
    position (decoding) and sees every key; otherwise queries start at key 0 (top-left, as sdpa's
    ``is_causal``). A sliding window counts back from the query's position. None when nothing is
    masked.
    """
    q_offset = kv_length - 1 if q_length == 1 else 0
    causal = is_causal and q_length > 1
    window = sliding_window is not None and kv_length > sliding_window
    if not causal and not window:
        return None
    q = (torch.arange(q_length, device=device) + q_offset)[:, None]
    kv = torch.arange(kv_length, device=device)[None, :]
    mask = torch.ones(q_length, kv_length, dtype=torch.bool, device=device)
    if causal:
        mask &= kv <= q
    if window:
        if is_causal:
            mask &= kv > q - sliding_window
        else:
            mask &= (q - kv).abs() <= sliding_window
    return mask[None, None]
