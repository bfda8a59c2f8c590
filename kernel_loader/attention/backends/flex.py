"""FlexAttention behind transformers' attention-function contract.

On accelerators ``flex_attention`` is compiled once (a fused kernel). On the CPU it runs
uncompiled: compiling costs ~30 s per shape on a 2-core machine (measured with torch 2.13), and
the eager path is exact. Pass ``flex_compile=True``/``False`` to force either.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

from kernel_loader.attention.backends.contract import implicit_mask, kv_groups, repeat_kv, resolve_is_causal
from kernel_loader.errors import UnsupportedAttentionOptionError

__all__ = ["flex_attention_forward"]


@functools.lru_cache(maxsize=1)
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _block_mask_from_bool(mask: torch.Tensor, q_length: int, kv_length: int) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    batch = mask.shape[0]
    dense = mask[:, 0] if mask.shape[1] == 1 else None
    if dense is None:
        return None

    def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return dense[b, q, kv]

    device = mask.device
    return create_block_mask(mask_mod, B=batch, H=None, Q_LEN=q_length, KV_LEN=kv_length, device=device, _compile=False)


def flex_attention_forward(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    position_bias: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
    output_attentions: bool = False,
    flex_compile: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention through ``torch.nn.attention.flex_attention``.

    ``attention_mask`` is a ``BlockMask`` (from ``flex_attention_mask``), a 4D float/bool tensor
    (applied in ``score_mod``), or None (causality and ``sliding_window`` are then built here).
    ``softcap`` is applied in ``score_mod`` as ``softcap * tanh(score / softcap)``.

    Returns:
        ``(out [B, Sq, Hq, D] contiguous, None)``.

    Raises:
        UnsupportedAttentionOptionError: ``dropout > 0`` while training, attention sinks
            (``s_aux``) or ``output_attentions=True``; FlexAttention has none of them.
    """
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    if dropout and getattr(module, "training", True):
        raise UnsupportedAttentionOptionError(
            f"attn_implementation='flex_attention' has no attention dropout (dropout={dropout}). Call "
            "model.eval(), set the attention dropout to 0, or use 'sdpa'/'eager'."
        )
    if s_aux is not None:
        raise UnsupportedAttentionOptionError(
            "attn_implementation='flex_attention' does not apply attention sinks (s_aux); use 'eager'."
        )
    if output_attentions:
        raise UnsupportedAttentionOptionError(
            "attn_implementation='flex_attention' returns no attention weights; use 'eager' for output_attentions."
        )

    q_length, kv_length = query.shape[2], key.shape[2]
    block_mask = None
    score_mask = None
    if isinstance(attention_mask, BlockMask):
        block_mask = attention_mask
    elif attention_mask is None:
        implicit = implicit_mask(q_length, kv_length, resolve_is_causal(module, is_causal), sliding_window, query.device)
        if implicit is not None:
            block_mask = _block_mask_from_bool(implicit.expand(query.shape[0], 1, -1, -1), q_length, kv_length)
    elif attention_mask.dtype == torch.bool:
        block_mask = _block_mask_from_bool(attention_mask[..., :kv_length], q_length, kv_length)
        if block_mask is None:  # per-head bool mask: apply through score_mod instead
            score_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~attention_mask, torch.finfo(query.dtype).min
            )
    else:
        score_mask = attention_mask[..., :kv_length]

    def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if score_mask is not None:
            score = score + score_mask[b, h if score_mask.shape[1] > 1 else 0, q_idx, kv_idx]
        if position_bias is not None:
            score = score + position_bias[b, h, q_idx, kv_idx]
        return score

    n_rep = kv_groups(query, key)
    enable_gqa = n_rep > 1
    hq = query.shape[1]
    if enable_gqa and hq & (hq - 1):
        # flex's GQA path wants a power-of-two head count
        key, value, enable_gqa = repeat_kv(key, n_rep), repeat_kv(value, n_rep), False

    compile_it = flex_compile if flex_compile is not None else query.device.type != "cpu"
    fn = _compiled_flex() if compile_it else flex_attention
    needs_score_mod = softcap is not None or score_mask is not None or position_bias is not None
    with warnings.catch_warnings():
        # the "called without torch.compile()" notice: running uncompiled is our choice on the CPU
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        out = fn(
            query,
            key,
            value,
            score_mod=score_mod if needs_score_mod else None,
            block_mask=block_mask,
            scale=scaling,
            enable_gqa=enable_gqa,
        )
    return out.transpose(1, 2).contiguous(), None
