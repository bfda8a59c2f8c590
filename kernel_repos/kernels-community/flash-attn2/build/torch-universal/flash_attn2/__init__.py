"""flash-attn2: FlashAttention 2's Python API, in Triton (GPU sm80+) with a PyTorch fallback.

Layouts follow flash-attn: q/k/v ``[batch, seqlen, heads, head_dim]``; the varlen functions
take packed ``[total_tokens, heads, head_dim]`` with int32 ``cu_seqlens``. ``causal`` is
bottom-right aligned when the query and key lengths differ; ``window_size=(left, right)`` uses -1
for unbounded; GQA/MQA when query heads are a multiple of key/value heads. With
``return_attn_probs=True`` the functions return ``(out, softmax_lse, None)``; lse is float32
``[batch, heads, seqlen_q]`` (dense) or ``[heads, total_q]`` (varlen).

Every function raises ValueError (bad shapes, dtypes or option ranges; head_dim > 256; float32
on the GPU) or NotImplementedError (bfloat16 under TRITON_INTERPRET=1), naming the limit.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple, Union

import torch

from . import _compiled, _launch
from ._autograd import attention as _attention
from ._autograd import decode_heads_first as _decode_heads_first

# a CUDA build of torch will compile or look up kernels: Triton's hash of its compiler, which
# every such key holds, is computed meanwhile (_launch.hash_compiler_in_background)
if torch.version.cuda is not None and os.environ.get("TRITON_INTERPRET", "0") != "1":
    _launch.hash_compiler_in_background()

__all__ = [
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
    "flash_attn_decode_heads_first",
]

Result = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor, None]]


def _result(out: torch.Tensor, lse: torch.Tensor, return_attn_probs: bool) -> Result:
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Result:
    """Attention over ``[B, S, H, D]`` tensors, differentiable.

    ``deterministic=True`` makes the backward bitwise repeatable. By default the sm90 backward
    may add dQ's shares through reduce-adds whose order varies (last bits of dQ; the Gluon
    backward, ``_gluon_dispatch.wants_gluon_backward``, and ``_triton_bwd.dq_mode``); elsewhere
    the backward is deterministic either way.
    Raises ValueError / NotImplementedError as the module docstring says.
    """
    out, lse = _attention(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                          window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                          need_lse=return_attn_probs, deterministic=deterministic)
    return _result(out, lse, return_attn_probs)


def flash_attn_decode_heads_first(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> Optional[torch.Tensor]:
    """An extension to flash-attn's API: one decode step in transformers' layout, no autograd.

    q ``[B, Hq, Sq, D]`` with Sq <= 16, k/v ``[B, Hk, Sk, D]`` (any strides); the options mean
    what they mean for :func:`flash_attn_func`. Returns ``out [B, Sq, Hq, D]`` contiguous, or None
    when this path does not serve the call (too many query tokens, gradients needed, the
    PyTorch fallback, or input :func:`flash_attn_func` would refuse): then call
    :func:`flash_attn_func` on ``.transpose(1, 2)`` views, which computes or raises. It skips
    building those views, which is a large share of an eager decode step's host time.
    """
    return _decode_heads_first(q, k, v, softmax_scale, causal, window_size, softcap)


def _gather_pages(cache: torch.Tensor, block_table: torch.Tensor, cu_seqlens_k: torch.Tensor) -> torch.Tensor:
    """Paged ``[num_blocks, page_size, H, D]`` -> packed ``[total_k, H, D]`` along cu_seqlens_k."""
    page = cache.shape[1]
    lens = cu_seqlens_k.diff().long()
    batch_ids = torch.repeat_interleave(torch.arange(lens.numel(), device=cache.device), lens)
    pos = torch.arange(int(cu_seqlens_k[-1]), device=cache.device) - cu_seqlens_k.long()[batch_ids]
    blocks = block_table.long()[batch_ids, pos // page]
    return cache.reshape(-1, *cache.shape[2:])[blocks * page + pos % page]


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Optional[torch.Tensor] = None,
) -> Result:
    """Attention over packed sequences ``[total, H, D]`` delimited by int32 ``cu_seqlens``.

    With ``block_table`` ``[B, max_pages]`` (int32), k/v are paged caches
    ``[num_blocks, page_size, Hk, D]`` and ``cu_seqlens_k`` gives each sequence's key count.
    Raises ValueError / NotImplementedError as the module docstring says.
    """
    if block_table is not None:
        if torch.compiler.is_compiling() and not (torch.is_grad_enabled()
                                                  and (q.requires_grad or k.requires_grad or v.requires_grad)):
            # traced by torch.compile: gathering the pages reads a length from cu_seqlens_k, which
            # a graph cannot hold; the whole call is one operator instead (no gradients)
            return _compiled.varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                                          softmax_scale, causal, window_size, softcap, alibi_slopes,
                                          return_attn_probs)
        if k.dim() != 4:
            raise ValueError(
                f"with block_table, k/v must be paged caches [num_blocks, page_size, heads, head_dim], "
                f"got shape {tuple(k.shape)}"
            )
        k = _gather_pages(k, block_table, cu_seqlens_k)
        v = _gather_pages(v, block_table, cu_seqlens_k)
    out, lse = _attention(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                          max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, dropout_p=dropout_p,
                          softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                          softcap=softcap, alibi_slopes=alibi_slopes, need_lse=return_attn_probs,
                          deterministic=deterministic)
    return _result(out, lse, return_attn_probs)


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Result:
    """``qkv`` ``[B, S, 3, H, D]``; otherwise as :func:`flash_attn_func`."""
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv must be [batch, seqlen, 3, heads, head_dim], got {tuple(qkv.shape)}")
    q, k, v = qkv.unbind(dim=2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Result:
    """``kv`` ``[B, Sk, 2, Hk, D]``; otherwise as :func:`flash_attn_func`."""
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"kv must be [batch, seqlen_k, 2, heads_k, head_dim], got {tuple(kv.shape)}")
    k, v = kv.unbind(dim=2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Result:
    """``qkv`` ``[total, 3, H, D]``; otherwise as :func:`flash_attn_varlen_func`."""
    if qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"qkv must be [total_tokens, 3, heads, head_dim], got {tuple(qkv.shape)}")
    q, k, v = qkv.unbind(dim=1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Result:
    """``kv`` ``[total_k, 2, Hk, D]``; otherwise as :func:`flash_attn_varlen_func`."""
    if kv.dim() != 4 or kv.shape[1] != 2:
        raise ValueError(f"kv must be [total_tokens, 2, heads_k, head_dim], got {tuple(kv.shape)}")
    k, v = kv.unbind(dim=1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs)


try:
    from ._kvcache import flash_attn_with_kvcache
except ImportError as _kvcache_error:  # a trimmed copy without _kvcache.py still serves the rest; say so when called
    _KVCACHE_ERROR = _kvcache_error

    def flash_attn_with_kvcache(*args, **kwargs):  # type: ignore[no-redef]
        """Unavailable: the kvcache module failed to import (the error says why)."""
        raise NotImplementedError(f"flash_attn_with_kvcache is unavailable in this build: {_KVCACHE_ERROR}")
