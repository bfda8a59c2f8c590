"""PyTorch ``scaled_dot_product_attention`` behind transformers' attention-function contract."""

from __future__ import annotations

from typing import Any

import torch

from kernel_loader.attention.backends.contract import implicit_mask, kv_groups, repeat_kv, resolve_is_causal
from kernel_loader.errors import UnsupportedAttentionOptionError

__all__ = ["sdpa_attention_forward"]


def _refuse(option: str, alternatives: str) -> UnsupportedAttentionOptionError:
    return UnsupportedAttentionOptionError(
        f"attn_implementation='sdpa' cannot apply {option}; results would silently differ. "
        f"Use {alternatives} instead."
    )


def sdpa_attention_forward(
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
    position_bias: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
    output_attentions: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention through ``torch.nn.functional.scaled_dot_product_attention``.

    ``attention_mask``: 4D bool (True attends) or float (added), or None. With None, sdpa's own
    ``is_causal`` is used when the query has more than one token (as in transformers: its causal
    mask is top-left aligned, so keys past the query length are cropped), and a ``sliding_window``
    shorter than the keys is applied rather than dropped. GQA uses ``enable_gqa`` without a mask
    and repeated KV heads with one (the fused kernels refuse masked GQA).

    Returns:
        ``(out [B, Sq, Hq, D] contiguous, None)``.

    Raises:
        UnsupportedAttentionOptionError: ``softcap``, ``s_aux`` (attention sinks) or
            ``output_attentions=True`` were asked for; sdpa has none of them.
    """
    if softcap is not None:
        raise _refuse(f"softcap={softcap}", "'eager', 'flex_attention' or a FlashAttention backend")
    if s_aux is not None:
        raise _refuse("attention sinks (s_aux)", "'eager' or a FlashAttention kernel with sinks")
    if output_attentions:
        raise _refuse("output_attentions=True (it returns no weights)", "'eager'")

    q_length = query.shape[2]
    causal = resolve_is_causal(module, is_causal)
    if attention_mask is None and sliding_window is not None and key.shape[2] > sliding_window:
        attention_mask = implicit_mask(q_length, key.shape[2], causal, sliding_window, query.device)

    n_rep = kv_groups(query, key)
    sdpa_kwargs: dict[str, Any] = {}
    if n_rep > 1:
        if attention_mask is None:
            sdpa_kwargs["enable_gqa"] = True
        else:
            key = repeat_kv(key, n_rep)
            value = repeat_kv(value, n_rep)

    use_is_causal = q_length > 1 and attention_mask is None and causal
    if use_is_causal and key.shape[2] > q_length:
        # top-left causal never reaches keys past q_length; cropping lets sdpa pick its flash kernel
        key = key[:, :, :q_length]
        value = value[:, :, :q_length]
        if position_bias is not None:
            position_bias = position_bias[..., :q_length]
    if attention_mask is not None:
        attention_mask = attention_mask[..., : key.shape[2]]

    if position_bias is not None:
        bias = position_bias.to(query.dtype)
        if attention_mask is None:
            if use_is_causal:
                tri = torch.ones(q_length, key.shape[2], dtype=torch.bool, device=query.device).tril()
                bias = bias.masked_fill(~tri, torch.finfo(query.dtype).min)
        elif attention_mask.dtype == torch.bool:
            bias = bias.masked_fill(~attention_mask, torch.finfo(query.dtype).min)
        else:
            bias = bias + attention_mask
        attention_mask, use_is_causal = bias, False

    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=use_is_causal,
        **sdpa_kwargs,
    )
    return out.transpose(1, 2).contiguous(), None
