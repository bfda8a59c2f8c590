"""FlashAttention 3's Python API (the ``flash_attn_interface`` module built from flash-attention's
``hopper/`` folder), run on the kernel the ``flash_attention_3`` fallback chain picks.

FA3 differs from FA2: no ``dropout_p``; ``qv``, fp8 descales and ``attention_chunk``;
``seqused_q`` / ``seqused_k`` for varlen; ``page_table`` (FA2: ``block_table``) and
``cu_seqlens_q`` / ``cu_seqlens_k_new`` for the KV-cache call; ``return_attn_probs`` answers
``(out, softmax_lse)``. When the chain's kernel speaks FA2's API (the shipped ``flash-attn2``
serves ``flash_attention_3`` when no FA3 kernel is available), FA3-only options are refused unless
they hold their defaults (see :mod:`kernel_loader.flash_attn_compat.calls`).

Nothing here imports torch: the kernel (and with it torch) is loaded on the first call.
"""

from __future__ import annotations

from kernel_loader.flash_attn_compat.calls import call_kernel

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]

CHAIN = "flash_attention_3"


def flash_attn_func(
    q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False,
    sm_margin=0, return_attn_probs=False,
):
    """Attention over ``[batch, seqlen, heads, head_dim]`` q/k/v (FA3 semantics)."""
    return call_kernel(CHAIN, flash_attn_func, locals())


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None, seqused_k=None,
    softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False,
    sm_margin=0, return_attn_probs=False,
):
    """Attention over packed ``[total_tokens, heads, head_dim]`` sequences delimited by int32 ``cu_seqlens``."""
    return call_kernel(CHAIN, flash_attn_varlen_func, locals())


def flash_attn_with_kvcache(
    q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
    cache_batch_idx=None, cache_leftpad=None, page_table=None, cu_seqlens_q=None, cu_seqlens_k_new=None,
    max_seqlen_q=None, rotary_seqlens=None, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
    causal=False, window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
    scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0, return_softmax_lse=False,
):
    """Attention of ``q`` over a (possibly paged, ``page_table``) KV cache, appending ``k``/``v`` first."""
    return call_kernel(CHAIN, flash_attn_with_kvcache, locals())
