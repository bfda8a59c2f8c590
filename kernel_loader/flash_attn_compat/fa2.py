"""flash-attn 2's Python API (``flash_attn`` and ``flash_attn.flash_attn_interface``), run on the
kernel the ``flash_attention_2`` fallback chain picks.

The signatures are flash-attn 2.8's, spelled out rather than ``*args, **kwargs``: transformers
reads them with ``inspect.signature`` to decide which options (dropout, window, softcap,
block_table, ...) it may pass. Each call forwards every argument by keyword to the function of
the same name in the chosen kernel (:func:`kernel_loader.flash_attn_compat.calls.call_kernel`),
which computes the attention or raises (ValueError / NotImplementedError naming the limit, for the
shipped kernel).

Nothing here imports torch: the kernel (and with it torch) is loaded on the first call.
"""

from __future__ import annotations

from kernel_loader.flash_attn_compat.calls import call_kernel

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]

CHAIN = "flash_attention_2"


def flash_attn_func(
    q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False,
):
    """Attention over ``[batch, seqlen, heads, head_dim]`` q/k/v (flash-attn 2 semantics)."""
    return call_kernel(CHAIN, flash_attn_func, locals())


def flash_attn_qkvpacked_func(
    qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False,
):
    """``qkv`` ``[batch, seqlen, 3, heads, head_dim]``; otherwise as :func:`flash_attn_func`."""
    return call_kernel(CHAIN, flash_attn_qkvpacked_func, locals())


def flash_attn_kvpacked_func(
    q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False,
):
    """``kv`` ``[batch, seqlen_k, 2, heads_k, head_dim]``; otherwise as :func:`flash_attn_func`."""
    return call_kernel(CHAIN, flash_attn_kvpacked_func, locals())


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
    return_attn_probs=False, block_table=None,
):
    """Attention over packed ``[total_tokens, heads, head_dim]`` sequences delimited by int32
    ``cu_seqlens``; with ``block_table``, k/v are paged caches ``[num_blocks, page_size, heads_k, head_dim]``."""
    return call_kernel(CHAIN, flash_attn_varlen_func, locals())


def flash_attn_varlen_qkvpacked_func(
    qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
):
    """``qkv`` ``[total_tokens, 3, heads, head_dim]``; otherwise as :func:`flash_attn_varlen_func`."""
    return call_kernel(CHAIN, flash_attn_varlen_qkvpacked_func, locals())


def flash_attn_varlen_kvpacked_func(
    q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
    return_attn_probs=False,
):
    """``kv`` ``[total_k, 2, heads_k, head_dim]``; otherwise as :func:`flash_attn_varlen_func`."""
    return call_kernel(CHAIN, flash_attn_varlen_kvpacked_func, locals())


def flash_attn_with_kvcache(
    q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
    cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
    window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
    return_softmax_lse=False,
):
    """Attention of ``q`` over a (possibly paged) KV cache, appending ``k``/``v`` in place first."""
    return call_kernel(CHAIN, flash_attn_with_kvcache, locals())
