"""Eager attention: matmul, additive mask, softmax in float32, matmul. Returns the weights.

The reference every other backend is compared against; it honours every option (softcap,
dropout, GQA, sinks) so nothing needs to raise here.
"""

from __future__ import annotations

from typing import Any

import torch

from kernel_loader.attention.backends.contract import implicit_mask, kv_groups, repeat_kv, resolve_is_causal

__all__ = ["eager_attention_forward"]


def eager_attention_forward(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention the plain way (transformers' attention-function contract).

    ``query`` is ``[B, Hq, Sq, D]``, ``key``/``value`` ``[B, Hkv, Skv, D]``. ``attention_mask`` is a
    4D float mask added to the scores (0 attends, dtype-min masks) or a 4D bool mask (True
    attends); when None, causality (``is_causal``/``module.is_causal``) and ``sliding_window`` are
    applied here rather than dropped. ``s_aux`` (one sink logit per head) joins the softmax.

    Returns:
        ``(out [B, Sq, Hq, D] contiguous, weights [B, Hq, Sq, Skv])``.

    Raises:
        ValueError: head counts that do not divide.
    """
    n_rep = kv_groups(query, key)
    key = repeat_kv(key, n_rep)
    value = repeat_kv(value, n_rep)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5

    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap

    if attention_mask is None:
        attention_mask = implicit_mask(
            query.shape[2], key.shape[2], resolve_is_causal(module, is_causal), sliding_window, query.device
        )
    if attention_mask is not None:
        attention_mask = attention_mask[..., : key.shape[2]]
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask

    # float32 softmax for half types; float64 inputs (references) keep their precision
    softmax_dtype = torch.promote_types(scores.dtype, torch.float32)
    if s_aux is not None:
        sinks = s_aux.reshape(1, -1, 1, 1).to(scores.dtype).expand(scores.shape[0], -1, scores.shape[2], 1)
        combined = torch.cat([scores, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        weights = torch.softmax(combined, dim=-1, dtype=softmax_dtype)[..., :-1].to(query.dtype)
    else:
        weights = torch.softmax(scores, dim=-1, dtype=softmax_dtype).to(query.dtype)
    training = bool(getattr(module, "training", False))
    if dropout and training:
        weights = torch.nn.functional.dropout(weights, p=dropout, training=True)
    out = torch.matmul(weights, value)
    return out.transpose(1, 2).contiguous(), weights
