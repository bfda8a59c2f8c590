"""Writing the new keys/values of ``flash_attn_with_kvcache`` into the (paged) cache, in place.

One Triton program copies the K and V vectors of one (row, new token, kv head). Whether a write
happens is decided on the device, so a call needs no host sync and can be captured in a CUDA
graph whatever the lengths and block table hold: a write is made only when the row is not a
padding row (``cache_seqlens[b] >= 0``), the position is below the capacity, and the cache row
it lands in (the page from ``block_table``, else ``cache_batch_idx[b]`` or ``b``) is one of the
cache's rows; every other write is dropped. Padded batches built for CUDA graphs (transformers'
continuous batching pads with ``cache_seqlens = -1`` and block-table rows of -1) therefore touch
nothing. The same program writes each row's key count after the append, the lengths the
attention kernel reads, so no separate launch computes them.

Entry point: :func:`append_kv`; ``_kvcache`` checks shapes and dtypes first.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._launch import Launcher
from ._triton_fwd import next_pow2_dim

# Left unspecialised (keyed on their width alone): strides and lengths change between calls and
# a key per integer's divisibility would only cost host time on every decode step.
_RUNTIME_INTS = (
    "stride_kcb", "stride_kcs", "stride_kch", "stride_vcb", "stride_vcs", "stride_vch",
    "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs", "stride_vh", "stride_btb",
    "seqlen_new", "uniform_len", "capacity", "cache_rows", "head_dim",
)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _append_kernel(
    K_CACHE, V_CACHE, K_NEW, V_NEW, LENS, BLOCK_TABLE, ROWS, TOTAL,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_btb,
    seqlen_new, uniform_len, capacity, cache_rows, head_dim,
    PAGE_SIZE: tl.constexpr, HAS_LENS: tl.constexpr, HAS_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    hk = tl.program_id(1)
    b = pid // seqlen_new
    t = pid % seqlen_new
    if HAS_LENS:
        start = tl.load(LENS + b)
    else:
        start = uniform_len + 0 * b  # a tensor like the loaded length
    pos = start + t
    ok = (start >= 0) & (pos < capacity)
    # The address is computed from a clamped position, so even a dropped write reads its block
    # table entry inside the row.
    safe = tl.minimum(tl.maximum(pos, 0), capacity - 1)
    if PAGE_SIZE > 0:
        row = tl.load(BLOCK_TABLE + b * stride_btb + safe // PAGE_SIZE)
        slot = safe % PAGE_SIZE
    else:
        if HAS_ROWS:
            row = tl.load(ROWS + b)
        else:
            row = b
        slot = safe
    ok = ok & (row >= 0) & (row < cache_rows)
    row = row.to(tl.int64)
    slot = slot.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask = offs_d < tl.where(ok, head_dim, 0)  # (a scalar `& ok` is refused by the interpreter)
    b64 = b.to(tl.int64)
    k = tl.load(K_NEW + b64 * stride_kb + t * stride_ks + hk * stride_kh + offs_d, mask=mask)
    tl.store(K_CACHE + row * stride_kcb + slot * stride_kcs + hk * stride_kch + offs_d, k, mask=mask)
    v = tl.load(V_NEW + b64 * stride_vb + t * stride_vs + hk * stride_vh + offs_d, mask=mask)
    tl.store(V_CACHE + row * stride_vcb + slot * stride_vcs + hk * stride_vch + offs_d, v, mask=mask)
    if HAS_LENS:
        if (t == 0) & (hk == 0):
            tl.store(TOTAL + b, tl.where(start >= 0, tl.minimum(start + seqlen_new, capacity), 0))


_APPEND = Launcher(_append_kernel)


def supported(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`append_kv` takes these tensors: head_dim contiguous in all four (the
    caches must be written in place, so they are never copied to make it so)."""
    return k_cache.stride(3) == 1 and v_cache.stride(3) == 1 and k.stride(3) == 1 and v.stride(3) == 1


def append_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lens: Optional[torch.Tensor],
    uniform_len: int,
    capacity: int,
    block_table: Optional[torch.Tensor],
    cache_batch_idx: Optional[torch.Tensor],
) -> Optional[torch.Tensor]:
    """Write ``k``/``v`` ``[B, S_new, Hk, D]`` at positions ``lens[b] + t`` (``uniform_len + t``
    when ``lens`` is None) of each row, in place, dropping the writes the module docstring lists.

    Returns each row's key count after the append as int32 ``[B]`` (0 for a padding row, at most
    ``capacity``), or None when ``lens`` is None (then every row holds ``uniform_len + S_new``,
    which the caller checked on the host). Raises nothing itself: ``_kvcache`` checks the
    arguments; :func:`supported` must hold.
    """
    batch, seqlen_new, num_kv_heads, head_dim = k.shape
    total = torch.empty(batch, dtype=torch.int32, device=k.device) if lens is not None else None
    if batch == 0 or seqlen_new == 0 or num_kv_heads == 0:
        return lens
    if capacity == 0 or k_cache.shape[0] == 0:
        return total.zero_() if total is not None else None
    bt_stride = block_table.stride(0) if block_table is not None else 0
    _APPEND(
        (batch * seqlen_new, num_kv_heads, 1),
        (
            k_cache, v_cache, k, v, lens, block_table, cache_batch_idx, total,
            *k_cache.stride()[:3], *v_cache.stride()[:3], *k.stride()[:3], *v.stride()[:3], bt_stride,
            seqlen_new, int(uniform_len), capacity, k_cache.shape[0], head_dim,
        ),
        (k_cache.shape[1] if block_table is not None else 0, lens is not None, cache_batch_idx is not None,
         next_pow2_dim(head_dim)),
        1, 1,
    )
    return total
